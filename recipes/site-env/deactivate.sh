# shellcheck shell=sh
# site-env-@SITE@: undo activate.d/site-env-@SITE@.sh exactly.
#
# Sourced into the user's shell like the activation script (POSIX sh, no `set -e`/`-u`). Each
# variable listed in SITE_ENV_VARS gets back the value saved in SITE_ENV_BACKUP_<NAME> (also when
# that value was empty), or is unset when it had none before activation.

site_env_rest="${SITE_ENV_VARS:-}"
while [ -n "$site_env_rest" ]; do
    site_env_name="${site_env_rest%% *}"
    case "$site_env_rest" in
        *" "*) site_env_rest="${site_env_rest#* }" ;;
        *) site_env_rest="" ;;
    esac
    if eval "[ -n \"\${SITE_ENV_BACKUP_${site_env_name}+x}\" ]"; then
        eval "export ${site_env_name}=\"\${SITE_ENV_BACKUP_${site_env_name}}\""
        unset "SITE_ENV_BACKUP_${site_env_name}"
    else
        unset "${site_env_name}"
    fi
done
unset SITE_ENV_VARS site_env_rest site_env_name
