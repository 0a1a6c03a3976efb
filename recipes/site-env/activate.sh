# shellcheck shell=sh
# The helpers below are called by the site settings spliced in at @SITE_SETTINGS@ at build time,
# which shellcheck cannot see here.
# shellcheck disable=SC2317
# site-env-@SITE@: apply the @SITE@ site profile's runtime settings (see docs/howto/add-a-site.md).
#
# conda sources this file into the user's own shell (bash, zsh, dash), so it is POSIX sh, never
# `set -e`/`-u` (that would change the user's shell options), and safe under a user's `set -u`.
# csh/tcsh and fish get the same changes: their activate.d wrappers run this file with sh and
# SITE_ENV_EMIT=csh or fish, and it prints each change as a command of that shell.
#
# Records are kept per activation level (CONDA_SHLVL, which conda and mamba set to the level being
# activated before they source activate.d, and keep while they source deactivate.d; 0 outside
# conda), so stacked environments each get back exactly what they found: every variable this
# level touches is listed in SITE_ENV_VARS_<level>, and its earlier value, when it had one (even
# an empty one), kept in SITE_ENV_BACKUP_<level>_<NAME>; deactivate.d/site-env-@SITE@.sh puts
# them back and clears only that level's record.
case "${CONDA_SHLVL:-}" in
    '' | *[!0-9]*) site_env_level=0 ;;
    *) site_env_level="$CONDA_SHLVL" ;;
esac

# site_env_put NAME VALUE / site_env_drop NAME: export or unset NAME, and print the same change
# for the shell named in SITE_ENV_EMIT (values quoted for that shell).
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

# Record NAME's state before this level first changes it; a repeated activation keeps the record.
site_env_record() {
    site_env_vars=""
    eval "site_env_vars=\"\${SITE_ENV_VARS_${site_env_level}:-}\""
    case " $site_env_vars " in
        *" $1 "*) return 0 ;;
    esac
    if eval "[ -n \"\${$1+x}\" ]"; then
        eval "site_env_put SITE_ENV_BACKUP_${site_env_level}_$1 \"\${$1}\""
    fi
    site_env_put "SITE_ENV_VARS_${site_env_level}" "${site_env_vars:+$site_env_vars }$1"
}

# site_env_set NAME VALUE: export NAME=VALUE for as long as the environment is active.
site_env_set() {
    site_env_record "$1"
    site_env_put "$1" "$2"
}

# site_env_unset NAME: remove NAME (a setting known to hurt on this site) while active.
site_env_unset() {
    site_env_record "$1"
    site_env_drop "$1"
}

# The first network interface that is not loopback, a docker bridge or a container's veth end,
# and not down, in name order from /sys/class/net (SITE_ENV_NET_DIR replaces it in tests).
site_env_first_interface() {
    for site_env_dev in "${SITE_ENV_NET_DIR:-/sys/class/net}"/*; do
        site_env_if="${site_env_dev##*/}"
        case "$site_env_if" in
            lo | docker* | veth* | br-* | '*') continue ;;
        esac
        if [ -r "$site_env_dev/operstate" ] && [ "$(cat "$site_env_dev/operstate")" = down ]; then
            continue
        fi
        printf '%s\n' "$site_env_if"
        unset site_env_dev site_env_if
        return 0
    done
    unset site_env_dev site_env_if
    return 1
}

site_env_set SITE_ENV_PROFILE '@SITE@'
# @SITE_SETTINGS@

unset -f site_env_put site_env_drop site_env_record site_env_set site_env_unset site_env_first_interface
unset site_env_level site_env_vars
