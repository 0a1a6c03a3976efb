# shellcheck shell=sh
# The helpers are called through eval, which shellcheck cannot follow.
# shellcheck disable=SC2317
# site-env-@SITE@: undo activate.d/site-env-@SITE@.sh exactly, for this activation level only.
#
# Sourced into the user's shell like the activation script (POSIX sh, no `set -e`/`-u`); run with
# sh by the csh and fish wrappers, with SITE_ENV_EMIT saying which shell's commands to print. Each
# variable listed in SITE_ENV_VARS_<level> (level: CONDA_SHLVL, 0 outside conda) gets back the
# value saved in SITE_ENV_BACKUP_<level>_<NAME> (also when that value was empty), or is unset when
# it had none; the records of lower levels (stacked environments) stay as they are.
case "${CONDA_SHLVL:-}" in
    '' | *[!0-9]*) site_env_level=0 ;;
    *) site_env_level="$CONDA_SHLVL" ;;
esac

site_env_put() {
    export "$1=$2"
    case "${SITE_ENV_EMIT:-}" in
        csh) printf "setenv %s '%s';\n" "$1" "$(printf '%s' "$2" | sed -e "s/'/'\\\\''/g" -e 's/!/\\!/g')" ;;
        fish) printf "set -gx %s '%s';\n" "$1" "$(printf '%s' "$2" | sed "s/[\\\\']/\\\\&/g")" ;;
    esac
}
site_env_drop() {
    unset "$1"
    case "${SITE_ENV_EMIT:-}" in
        csh) printf 'unsetenv %s;\n' "$1" ;;
        fish) printf 'set -e %s;\n' "$1" ;;
    esac
}

eval "site_env_rest=\"\${SITE_ENV_VARS_${site_env_level}:-}\""
while [ -n "$site_env_rest" ]; do
    site_env_name="${site_env_rest%% *}"
    case "$site_env_rest" in
        *" "*) site_env_rest="${site_env_rest#* }" ;;
        *) site_env_rest="" ;;
    esac
    site_env_backup="SITE_ENV_BACKUP_${site_env_level}_${site_env_name}"
    if eval "[ -n \"\${${site_env_backup}+x}\" ]"; then
        eval "site_env_put \"\$site_env_name\" \"\${${site_env_backup}}\""
        site_env_drop "$site_env_backup"
    else
        site_env_drop "$site_env_name"
    fi
done
if eval "[ -n \"\${SITE_ENV_VARS_${site_env_level}+x}\" ]"; then
    site_env_drop "SITE_ENV_VARS_${site_env_level}"
fi
unset -f site_env_put site_env_drop
unset site_env_level site_env_rest site_env_name site_env_backup
