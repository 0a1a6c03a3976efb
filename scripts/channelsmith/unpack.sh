#!/bin/sh
# Install the environment of a channelsmith bundle on a node with no channelsmith, conda or pixi-unpack.
#
#   tar -xf env.tar -C bundle && sh bundle/unpack.sh PREFIX && . PREFIX/activate.sh
#
# Needs a POSIX shell and utilities (cat chmod cp dirname grep mkdir rm sed uname; mktemp) plus what the
# .conda format needs: unzip (a .conda file is a zip) and zstd (holding zstd-compressed tars), tar,
# and sha256sum (coreutils) to check every package against the lock before anything is written;
# bzip2 too when the bundle holds .tar.bz2 packages.
# What it does per package comes from channelsmith-unpack/files.tsv, which channelsmith pack wrote:
# copy each file to its place (noarch: python files already mapped into site-packages), replace the
# build prefix in text files, write Python entry points, then the conda-meta records, the lock and
# activate.sh. It does not replace prefixes inside binary files; a bundle that needs that is refused
# before anything is written (install it with channelsmith deploy --bundle or pixi-unpack).
# Exit status: 0 done, 2 refused or failed (nothing left behind), 130/143 interrupted (likewise).
set -eu

die() {
    printf 'unpack.sh: error: %s\n' "$1" >&2
    if [ -n "${2:-}" ]; then printf 'unpack.sh: hint: %s\n' "$2" >&2; fi
    exit 2
}

if [ "$#" -ne 1 ] || [ -z "$1" ]; then
    die "usage: sh unpack.sh PREFIX" "PREFIX is a new or empty directory to install the environment into"
fi

for tool in cat chmod cp dirname grep mkdir mktemp rm sed uname tar unzip zstd sha256sum; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "unpack.sh needs $tool, which is not on PATH" \
            "install $tool (Debian: unzip, zstd, tar, coreutils, sed, grep), or use deploy --bundle or pixi-unpack"
done

here=$(cd "$(dirname "$0")" && pwd)
inputs=$here/channelsmith-unpack
if [ ! -f "$here/pixi-pack.json" ] || [ ! -f "$inputs/files.tsv" ] || [ ! -f "$inputs/sha256sums" ]; then
    die "$here is not an extracted channelsmith bundle (pixi-pack.json or channelsmith-unpack/ missing)" \
        "extract the whole bundle first: tar -xf FILE.tar -C DIR, then sh DIR/unpack.sh PREFIX"
fi

# The platform the bundle was packed for must be this machine's (names as conda's subdirs).
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) here_platform=linux-64 ;;
    Linux-aarch64) here_platform=linux-aarch64 ;;
    Linux-ppc64le) here_platform=linux-ppc64le ;;
    Darwin-x86_64) here_platform=osx-64 ;;
    Darwin-arm64) here_platform=osx-arm64 ;;
    *) here_platform="$(uname -s)-$(uname -m)" ;;
esac
bundle_platform=$(sed -n 's/.*"platform": *"\([^"]*\)".*/\1/p' "$here/pixi-pack.json")
[ "$bundle_platform" = "$here_platform" ] ||
    die "this bundle is for $bundle_platform, and this machine is $here_platform" \
        "pack a lock written on $here_platform (channelsmith pack --lock LOCK --platform $here_platform)"

case $1 in
    /*) prefix=$1 ;;
    *) prefix=$(pwd)/$1 ;;
esac
case $prefix in
    *"'"* | *"\\"* | *"
"* | *"	"*) die "the prefix $prefix holds a quote, backslash, tab or newline" "pass a plainer path" ;;
esac
if [ -e "$prefix" ]; then
    [ -d "$prefix" ] || die "prefix $prefix is a file" "pass a new or empty directory"
    if [ -d "$prefix/conda-meta" ]; then
        die "prefix $prefix already holds an environment" "pass a new or empty directory, or remove this one first"
    fi
    for entry in "$prefix"/* "$prefix"/.[!.]* "$prefix"/..?*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        die "prefix $prefix is not empty" "pass a new or empty directory"
    done
    created=0
else
    created=1
fi

# .tar.bz2 packages (the older format) need bzip2 behind tar -j.
if grep -q '^P	.*\.tar\.bz2	' "$inputs/files.tsv" && ! command -v bzip2 >/dev/null 2>&1; then
    die "a package of this bundle is a .tar.bz2 file, and bzip2 is not on PATH" "install bzip2, then run it again"
fi
if grep -q '^B	' "$inputs/files.tsv"; then
    die "a package of this bundle needs binary prefix replacement, which unpack.sh does not do" \
        "install it with channelsmith deploy --bundle FILE.tar --prefix DIR, or pixi-unpack"
fi
(cd "$here" && sha256sum -c "$inputs/sha256sums" >/dev/null 2>&1) ||
    die "a package in $here is missing or differs from the sha256 its lock records" \
        "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"

work=$(mktemp -d "${TMPDIR:-/tmp}/channelsmith-unpack.XXXXXX") ||
    die "cannot create a temporary directory in ${TMPDIR:-/tmp}" "point TMPDIR at a writable directory with free space"
finished=0
cleanup() {
    status=$?
    rm -rf "$work"
    [ "$finished" -eq 0 ] || return 0
    if [ "$created" -eq 1 ]; then
        rm -rf "$prefix"
    else
        rm -rf "${prefix:?}"/* "${prefix:?}"/.[!.]* "${prefix:?}"/..?*
    fi
    case $status in
        2 | 130 | 143) printf 'unpack.sh: nothing was installed (%s is as it was)\n' "$prefix" >&2 ;;
        *)
            printf 'unpack.sh: error: installing into %s failed (a command above exited %s); nothing was left there\n' \
                "$prefix" "$status" >&2
            printf 'unpack.sh: hint: check free space (df -h %s) and that you can write there, then run it again\n' \
                "$(dirname "$prefix")" >&2
            exit 2
            ;;
    esac
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$prefix"

# sed needs the placeholder as a pattern and the prefix as a replacement, both escaped.
escape_pattern() { printf '%s\n' "$1" | sed 's/[]\/$*.^[]/\\&/g'; }
escape_replacement() { printf '%s\n' "$1" | sed 's/[\/&]/\\&/g'; }
replacement=$(escape_replacement "$prefix")

unpack_package() { # archive, stem -> the package's files under $work/$stem
    mkdir -p "$work/$2"
    case $1 in
        *.conda)
            unzip -q -o "$1" "pkg-$2.tar.zst" -d "$work/$2.zip"
            zstd -q -d -f "$work/$2.zip/pkg-$2.tar.zst" -o "$work/$2.tar"
            tar -xf "$work/$2.tar" -C "$work/$2"
            rm -rf "$work/$2.zip" "$work/$2.tar"
            ;;
        *.tar.bz2) tar -xjf "$1" -C "$work/$2" ;;
        *) die "$1 is not a .conda or .tar.bz2 package" ;;
    esac
}

place() { # source in the package, target in the prefix
    mkdir -p "$(dirname "$prefix/$2")"
    rm -f "$prefix/$2"
    cp -P -p "$work/$stem/$1" "$prefix/$2"
}

tab=$(printf '\t')
stem=
count=0
while IFS=$tab read -r kind a b c d; do
    case $kind in
        P)
            stem=$b
            count=$((count + 1))
            unpack_package "$here/$a" "$stem"
            ;;
        D) mkdir -p "$prefix/$b" ;;
        F) place "$a" "$b" ;;
        T)
            place "$a" "$b"
            sed "s/$(escape_pattern "$c")/$replacement/g" "$prefix/$b" >"$work/replaced"
            cat "$work/replaced" >"$prefix/$b"
            ;;
        E)
            # The script conda's and rattler's installers write for a noarch: python entry point.
            mkdir -p "$(dirname "$prefix/$a")"
            cat >"$prefix/$a" <<EOF
#!$prefix/$b
# -*- coding: utf-8 -*-
import re
import sys

from $c import $d

if __name__ == '__main__':
	sys.argv[0] = re.sub(r'(-script\.pyw?|\.exe)?\$', '', sys.argv[0])
	sys.exit($d())
EOF
            chmod 755 "$prefix/$a"
            ;;
        *) die "unknown line kind '$kind' in $inputs/files.tsv" "pack the bundle again with channelsmith pack" ;;
    esac
done <"$inputs/files.tsv"

mkdir -p "$prefix/conda-meta"
cp "$inputs"/conda-meta/*.json "$prefix/conda-meta/"
: >"$prefix/conda-meta/history"
cp "$here/channelsmith.lock" "$prefix/channelsmith.lock"
cat >"$prefix/activate.sh" <<EOF
# Activate the environment in this prefix: . PREFIX/activate.sh (what conda activate also runs).
CONDA_PREFIX='$prefix'
export CONDA_PREFIX
PATH="\$CONDA_PREFIX/bin\${PATH:+:\$PATH}"
export PATH
for _channelsmith_script in "\$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do
    if [ -f "\$_channelsmith_script" ]; then . "\$_channelsmith_script"; fi
done
unset _channelsmith_script
EOF
finished=1
printf 'unpack.sh: installed %s packages into %s; activate with: . %s/activate.sh\n' "$count" "$prefix" "$prefix" >&2
