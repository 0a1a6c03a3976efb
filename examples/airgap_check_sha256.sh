#!/bin/sh
# Air gap, step 3' (docs/howto/air-gap.md): install a bundle with no channelsmith and no conda, checking a private
# copy with coreutils first. A script of the site's, not the bundle's: run it with sh from the folder
# holding env.tar, with ANCHORS (what came apart from the bundle), HEX (the sha256 pack printed) and PREFIX.
# POSIX sh on purpose (the compute node may have nothing else); there is no pipe, so -eu is the whole of it.
set -eu
B=$(mktemp -d) && cd "$B" || exit 2; trap 'cd / && rm -rf "$B"' EXIT   # a private folder (mode 0700), entered:
# read as "." from here on, so no one can swap it even where others can write TMPDIR, once it is found yours
[ "$(find . -prune -user "$(id -u)" -perm 700)" = . ] || { echo "$B is not yours alone: set TMPDIR" >&2; exit 2; }
cp "$OLDPWD/env.tar" . || exit 2   # stop if the copy fails: the checks below read the copy
sha256sum -c "$ANCHORS/env.tar.sha256" || exit 2   # coreutils' check, before anything from the bundle runs
tar -xf env.tar unpack.sh && sh unpack.sh --bundle env.tar --sha256 "$HEX" "$PREFIX"
