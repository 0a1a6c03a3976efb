#!/usr/bin/env bash
# linkage.sh LIB...: every shared library LIB (relative to $PREFIX) needs resolves inside the
# environment, to glibc, or under a host path listed in LINKAGE_HOST_PATHS (colon-separated,
# e.g. a site's /opt/cray/libfabric/1.15.2.0). Anything else, or anything "not found", fails.
set -euo pipefail

# glibc's own libraries come from the host on every conda system (the sysroot only links them).
glibc='^(linux-vdso\.so|ld-linux|libc\.so|libm\.so|libpthread\.so|librt\.so|libdl\.so|libutil\.so|libresolv\.so)'
IFS=: read -r -a host_paths <<<"${LINKAGE_HOST_PATHS:-}"

status=0
for lib in "$@"; do
    path="${PREFIX}/${lib}"
    if [[ ! -e "$path" ]]; then
        echo "linkage: ${lib} does not exist" >&2
        status=1
        continue
    fi
    while read -r name arrow target _; do
        [[ "${name##*/}" =~ $glibc ]] && continue
        if [[ "$arrow" != "=>" || "$target" == not ]]; then
            echo "linkage: ${lib}: ${name} not found" >&2
            status=1
            continue
        fi
        resolved="$(readlink -f "$target")"
        allowed=0
        for root in "$(readlink -f "$PREFIX")" "${host_paths[@]}"; do
            if [[ -n "$root" && "$resolved" == "$root"/* ]]; then
                allowed=1
            fi
        done
        if ((allowed)); then
            echo "linkage: ${lib}: ${name} -> ${resolved}"
        else
            echo "linkage: ${lib}: ${name} resolves outside the environment: ${resolved}" >&2
            status=1
        fi
    done < <(ldd "$path" | sed -e 's/^[[:space:]]*//')
done
exit "$status"
