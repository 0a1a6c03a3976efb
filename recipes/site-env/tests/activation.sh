#!/usr/bin/env bash
# Recipe test: activation sets this site's profile, and deactivation gives back the environment
# exactly as it was, whether SITE_ENV_PROFILE was set, set but empty, or unset before.
set -euo pipefail

site="${SITE_ENV_SITE:?set by recipe.yaml}"
activate="${PREFIX}/etc/conda/activate.d/site-env-${site}.sh"
deactivate="${PREFIX}/etc/conda/deactivate.d/site-env-${site}.sh"

# The engine activates the test environment (sourcing activate.d) before this script runs, as
# `conda activate` would: the profile must already be on. Deactivate it to start from a clean slate.
if [[ "${SITE_ENV_PROFILE:-}" != "$site" ]]; then
    echo "the activated test environment has SITE_ENV_PROFILE='${SITE_ENV_PROFILE:-}', expected '$site'" >&2
    exit 1
fi
# shellcheck source=/dev/null
. "$deactivate"

for prior in set empty unset; do
    case "$prior" in
        set) export SITE_ENV_PROFILE="before-activation" ;;
        empty) export SITE_ENV_PROFILE="" ;;
        unset) unset SITE_ENV_PROFILE ;;
    esac
    before="$(export -p)"

    # shellcheck source=/dev/null
    . "$activate"
    if [[ "${SITE_ENV_PROFILE:-}" != "$site" ]]; then
        echo "after activation SITE_ENV_PROFILE='${SITE_ENV_PROFILE:-}', expected '$site'" >&2
        exit 1
    fi
    # The record of this activation level (CONDA_SHLVL as the scripts read it; 0 outside conda).
    case "${CONDA_SHLVL:-}" in
        '' | *[!0-9]*) level=0 ;;
        *) level="$CONDA_SHLVL" ;;
    esac
    record="SITE_ENV_VARS_${level}"
    for name in ${!record}; do
        echo "prior $prior: $name=${!name-<unset>}"
    done

    # shellcheck source=/dev/null
    . "$deactivate"
    after="$(export -p)"
    if [[ "$before" != "$after" ]]; then
        echo "deactivation did not restore the environment (SITE_ENV_PROFILE was $prior):" >&2
        diff <(printf '%s\n' "$before") <(printf '%s\n' "$after") >&2
        exit 1
    fi
done
echo "site-env-${site}: activation and deactivation OK"
