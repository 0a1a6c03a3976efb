#!/usr/bin/env bash
# Print the URI of the Debian archive this machine's apt already uses: the first configured source
# (deb822 `.sources` stanza or one-line `deb` entry, enabled files only) whose suites include this
# release's codename. Sites use their own mirrors, so the repository names none.
#
#   bash scripts/debian-archive-uri.sh [ROOT]   ROOT (default /) holds etc/os-release and etc/apt/
#
# Exit 1, with the reason on stderr, when no such source is configured.
set -euo pipefail

root="${1:-/}"
codename=$(sed -n 's/^VERSION_CODENAME=//p' "${root%/}/etc/os-release" 2>/dev/null | tr -d '"')
if [ -z "$codename" ]; then
  echo "debian-archive-uri: ${root%/}/etc/os-release names no VERSION_CODENAME" >&2
  exit 1
fi

files=()
[ -f "${root%/}/etc/apt/sources.list" ] && files+=("${root%/}/etc/apt/sources.list")
for f in "${root%/}"/etc/apt/sources.list.d/*.list "${root%/}"/etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && files+=("$f")
done

uri=""
if [ "${#files[@]}" -gt 0 ]; then
  uri=$(awk -v codename="$codename" '
    # deb822: a stanza ends at a blank line; Types, URIs and Suites may come in any order.
    function flush() {
      if (types ~ / deb / && suites ~ (" " codename " ") && uri != "" && enabled) { print uri; found = 1; exit }
      types = ""; suites = ""; uri = ""; enabled = 1
    }
    BEGIN { enabled = 1 }
    FNR == 1 { flush() }
    /^[[:space:]]*$/ { flush(); next }
    /^Types:/ { types = " " substr($0, 7) " " }
    /^URIs:/ { uri = $2 }
    /^Suites:/ { suites = " " substr($0, 8) " " }
    /^Enabled:[[:space:]]*no/ { enabled = 0 }
    # one-line format: deb [options] URI SUITE COMPONENT...
    /^deb[[:space:]]/ {
      n = 2
      if ($2 ~ /^\[/) { while (n <= NF && $n !~ /\]$/) n++; n++ }
      if ($(n + 1) == codename) { print $n; found = 1; exit }
    }
    END { if (!found) flush() }
  ' "${files[@]}")
fi
if [ -z "$uri" ]; then
  echo "debian-archive-uri: no apt source for '${codename}' under ${root%/}/etc/apt" >&2
  exit 1
fi
printf '%s\n' "$uri"
