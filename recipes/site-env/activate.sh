# shellcheck shell=sh
# The helpers below are called by the site settings spliced in at @SITE_SETTINGS@ at build time,
# which shellcheck cannot see here.
# shellcheck disable=SC2317
# site-env-@SITE@: apply the @SITE@ site profile's runtime settings (see docs/sites.md).
#
# conda sources this file into the user's own shell (bash, zsh, dash), so it is POSIX sh, never
# `set -e`/`-u` (that would change the user's shell options), and safe under a user's `set -u`.
# Every variable it touches is recorded in SITE_ENV_VARS, and its earlier value, when it had one
# (even an empty one), in SITE_ENV_BACKUP_<NAME>; deactivate.d/site-env-@SITE@.sh puts them back.

# Record NAME's state before its first change; a repeated activation keeps the first record.
site_env_record() {
    case " ${SITE_ENV_VARS:-} " in
        *" $1 "*) return 0 ;;
    esac
    if eval "[ -n \"\${$1+x}\" ]"; then
        eval "export SITE_ENV_BACKUP_$1=\"\${$1}\""
    fi
    SITE_ENV_VARS="${SITE_ENV_VARS:+$SITE_ENV_VARS }$1"
    export SITE_ENV_VARS
}

# site_env_set NAME VALUE: export NAME=VALUE for as long as the environment is active.
site_env_set() {
    site_env_record "$1"
    export "$1=$2"
}

# site_env_unset NAME: remove NAME (a setting known to hurt on this site) while active.
site_env_unset() {
    site_env_record "$1"
    unset "$1"
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

unset -f site_env_record site_env_set site_env_unset site_env_first_interface
