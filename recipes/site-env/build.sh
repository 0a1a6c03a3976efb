#!/usr/bin/env bash
# Assemble this site's activation scripts from the shared templates and sites/<site>.sh.
set -euo pipefail

site="${SITE_ENV_SITE:?SITE_ENV_SITE is set by recipe.yaml from the site variant}"
# The site name becomes part of file names and a sed replacement: keep it to plain characters.
if [[ ! "$site" =~ ^[a-z0-9][a-z0-9_-]*$ ]]; then
    echo "site-env: site name '$site' must match [a-z0-9][a-z0-9_-]*" >&2
    exit 1
fi
settings="${RECIPE_DIR}/sites/${site}.sh"
if [[ ! -f "$settings" ]]; then
    echo "site-env: no settings for site '$site': add $settings" >&2
    exit 1
fi

activate_dir="${PREFIX}/etc/conda/activate.d"
deactivate_dir="${PREFIX}/etc/conda/deactivate.d"
mkdir -p "$activate_dir" "$deactivate_dir"
sed -e "s/@SITE@/${site}/g" -e "/# @SITE_SETTINGS@/{r ${settings}" -e 'd;}' \
    "${RECIPE_DIR}/activate.sh" >"${activate_dir}/site-env-${site}.sh"
sed -e "s/@SITE@/${site}/g" "${RECIPE_DIR}/deactivate.sh" >"${deactivate_dir}/site-env-${site}.sh"

# csh/tcsh and fish: conda sources activate.d/*.csh and *.fish in those shells. Each wrapper runs
# the POSIX script above with sh (CONDA_PREFIX is the environment while conda sources both
# directories) and applies the commands it prints, so every shell gets the same changes and records.
for change in activate deactivate; do
    script="\$CONDA_PREFIX/etc/conda/${change}.d/site-env-${site}.sh"
    printf '# site-env-%s for csh/tcsh: site-env-%s.sh beside this file makes the changes (see there).\n%s\n' \
        "$site" "$site" "eval \"\`env SITE_ENV_EMIT=csh sh ${script}\`\"" >"${PREFIX}/etc/conda/${change}.d/site-env-${site}.csh"
    printf '# site-env-%s for fish: site-env-%s.sh beside this file makes the changes (see there).\n%s\n' \
        "$site" "$site" "env SITE_ENV_EMIT=fish sh \"${script}\" | source" >"${PREFIX}/etc/conda/${change}.d/site-env-${site}.fish"
done
