#!/usr/bin/env bash
# linkage.sh LIB...: every shared library LIB (relative to $PREFIX) needs resolves inside the
# environment, to glibc, or under a host path listed in LINKAGE_HOST_PATHS (colon-separated,
# e.g. a site's /opt/cray/libfabric/1.15.2.0). Libraries that such a host library itself needs
# belong to the host's stack and are not judged. Anything else, or anything "not found", fails.
set -euo pipefail

# glibc's own libraries come from the host on every conda system (the sysroot only links them).
glibc='^(linux-vdso\.so|ld-linux|libc\.so|libm\.so|libpthread\.so|librt\.so|libdl\.so|libutil\.so|libresolv\.so)'
IFS=: read -r -a host_paths <<<"${LINKAGE_HOST_PATHS:-}"
env_root="$(readlink -f "$PREFIX")"

# ldd's view of FILE as "name<TAB>resolved path" lines ("not found" when unresolved); glibc skipped.
dependencies() {
    local name arrow target _
    while read -r name arrow target _; do
        [[ "${name##*/}" =~ $glibc ]] && continue
        if [[ "$arrow" != "=>" || "$target" == not ]]; then
            printf '%s\tnot found\n' "$name"
        else
            printf '%s\t%s\n' "$name" "$(readlink -f "$target")"
        fi
    done < <(ldd "$1" | sed -e 's/^[[:space:]]*//')
}

under_host_path() {
    local root
    for root in "${host_paths[@]}"; do
        [[ -n "$root" && "$1" == "$root"/* ]] && return 0
    done
    return 1
}

status=0
for lib in "$@"; do
    path="${PREFIX}/${lib}"
    if [[ ! -e "$path" ]]; then
        echo "linkage: ${lib} does not exist" >&2
        status=1
        continue
    fi
    mapfile -t deps < <(dependencies "$path")
    declare -A host_stack=()
    for dep in "${deps[@]}"; do
        resolved="${dep#*$'\t'}"
        if under_host_path "$resolved"; then
            while IFS=$'\t' read -r name _; do
                host_stack["$name"]=1
            done < <(dependencies "$resolved")
        fi
    done
    for dep in "${deps[@]}"; do
        name="${dep%%$'\t'*}"
        resolved="${dep#*$'\t'}"
        if [[ "$resolved" == "not found" ]]; then
            echo "linkage: ${lib}: ${name} not found" >&2
            status=1
        elif [[ "$resolved" == "$env_root"/* ]] || under_host_path "$resolved"; then
            echo "linkage: ${lib}: ${name} -> ${resolved}"
        elif [[ -n "${host_stack[$name]:-}" ]]; then
            echo "linkage: ${lib}: ${name} -> ${resolved} (needed by a host library)"
        else
            echo "linkage: ${lib}: ${name} resolves outside the environment: ${resolved}" >&2
            status=1
        fi
    done
    unset host_stack
done
exit "$status"
