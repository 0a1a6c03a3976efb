#!/bin/sh
# Air gap, step 3' for a signed bundle (docs/howto/air-gap.md): as airgap_check_sha256.sh, the check being
# OpenSSH's, with SIGNERS (the site's signers file) and PRINCIPAL (the signer's name in it) set too.
# POSIX sh on purpose (the compute node may have nothing else); there is no pipe, so -eu is the whole of it.
set -eu
B=$(mktemp -d) && cd "$B" || exit 2; trap 'cd / && rm -rf "$B"' EXIT   # a private folder (mode 0700), entered:
# read as "." from here on, so no one can swap it even where others can write TMPDIR, once it is found yours
[ "$(find . -prune -user "$(id -u)" -perm 700)" = . ] || { echo "$B is not yours alone: set TMPDIR" >&2; exit 2; }
cp "$OLDPWD/env.tar" . || exit 2   # stop if the copy fails: the checks below read the copy
ssh-keygen -Y verify -f "$SIGNERS" -I "$PRINCIPAL" -n channelsmith-bundle -s "$ANCHORS/env.tar.sig" <env.tar || exit 2
tar -xf env.tar unpack.sh && sh unpack.sh --bundle env.tar --allowed-signers "$SIGNERS" --signature "$ANCHORS/env.tar.sig" "$PREFIX"
