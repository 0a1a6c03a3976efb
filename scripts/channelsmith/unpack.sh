#!/bin/sh
# Install the environment of a channelsmith bundle on a node with no channelsmith, conda or pixi-unpack.
#
#   tar -xf env.tar -C bundle && sh bundle/unpack.sh --bundle env.tar --sha256 HEX PREFIX && . PREFIX/activate.sh
#
# HEX is the bundle's sha256 as channelsmith pack printed it (env.tar.sha256), carried apart from the
# bundle: env.tar must have it, and is then extracted again into a private folder and installed from
# there, so the bytes checked are the bytes installed. Every package is checked against the sha256 the
# lock records. Without --bundle/--sha256 that lock is the extracted one, which shows damage, not a
# change: whoever changed a package could have changed the lock too (docs/deploy.md says what each
# route proves).
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

usage="usage: sh unpack.sh [--bundle FILE.tar --sha256 HEX] PREFIX"
usage_hint="PREFIX is a new or empty directory; HEX is the bundle's sha256 that channelsmith pack printed"
bundle=
digest=
target=
while [ "$#" -gt 0 ]; do
    case $1 in
        --bundle | --sha256)
            if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value; $usage" "$usage_hint"; fi
            if [ "$1" = --bundle ]; then bundle=$2; else digest=$2; fi
            shift 2
            ;;
        -*) die "unknown option $1; $usage" "$usage_hint" ;;
        *)
            [ -z "$target" ] || die "two prefixes given ($target and $1); $usage" "$usage_hint"
            target=$1
            shift
            ;;
    esac
done
[ -n "$target" ] || die "no PREFIX given; $usage" "$usage_hint"
if [ -n "$bundle" ] && [ -z "$digest" ]; then
    die "--bundle needs --sha256: the bundle file proves nothing without the digest it must have" "$usage_hint"
fi
if [ -z "$bundle" ] && [ -n "$digest" ]; then
    die "--sha256 needs --bundle FILE.tar: the digest is the bundle file's, which unpack.sh checks and extracts" \
        "pass the tar you extracted this folder from: --bundle FILE.tar --sha256 HEX"
fi
for tool in cat chmod cp dirname grep mkdir mktemp rm sed uname tar unzip zstd sha256sum; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "unpack.sh needs $tool, which is not on PATH" \
            "install $tool (Debian: unzip, zstd, tar, coreutils, sed, grep), or use deploy --bundle or pixi-unpack"
done

digest=$(printf '%s\n' "$digest" | sed 'y/ABCDEF/abcdef/')
case $digest in
    *[!0-9a-f]*) die "--sha256 $digest is not a sha256 (64 hex digits)" "$usage_hint" ;;
esac
if [ -n "$digest" ] && [ "${#digest}" -ne 64 ]; then
    die "--sha256 $digest is not a sha256 (64 hex digits)" "$usage_hint"
fi

case $target in
    /*) prefix=$target ;;
    *) prefix=$(pwd)/$target ;;
esac
# The prefix goes into sh and Python quoting (activate.sh, entry points): refuse what would need escaping there.
case $prefix in
    *"'"* | *'"'* | *"\\"* | *'$'* | *'`'* | *"
"* | *"	"*) die "the prefix $prefix holds a quote, backslash, dollar sign, backquote, tab or newline" "pass a plainer path" ;;
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
# What a failed install removes: the prefix, or its first missing parent, which the install creates.
top=$prefix
while [ ! -e "$(dirname "$top")" ]; do top=$(dirname "$top"); done

work=$(mktemp -d "${TMPDIR:-/tmp}/channelsmith-unpack.XXXXXX") ||
    die "cannot create a temporary directory in ${TMPDIR:-/tmp}" "point TMPDIR at a writable directory with free space"
started=0
finished=0
cleanup() {
    status=$?
    rm -rf "$work"
    [ "$started" -eq 1 ] && [ "$finished" -eq 0 ] || return 0
    if [ "$created" -eq 1 ]; then
        rm -rf "$top"
    else
        rm -rf "${prefix:?}"/* "${prefix:?}"/.[!.]* "${prefix:?}"/..?*
    fi
    case $status in
        2 | 130 | 143)
            if [ "$created" -eq 1 ]; then
                printf 'unpack.sh: nothing was installed; %s, which it had made, was removed\n' "$top" >&2
            else
                printf 'unpack.sh: nothing was installed; %s is empty again\n' "$prefix" >&2
            fi
            ;;
        *)
            printf 'unpack.sh: error: installing into %s failed (a command above exited %s); nothing was left there\n' \
                "$prefix" "$status" >&2
            printf 'unpack.sh: hint: check free space (df -h %s) and that you can write there, then run it again\n' \
                "$(dirname "$top")" >&2
            exit 2
            ;;
    esac
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

here=$(cd "$(dirname "$0")" && pwd)
if [ -n "$bundle" ]; then
    [ -f "$bundle" ] || die "bundle $bundle does not exist" "pass the FILE.tar channelsmith pack wrote"
    actual=$(sha256sum <"$bundle") || die "cannot read $bundle" "check that you can read it"
    actual=${actual%% *}
    [ "$actual" = "$digest" ] ||
        die "$bundle has the sha256 $actual, not the $digest given with --sha256: it is not the bundle that was packed (damaged or changed on the way)" \
            "do not install it: copy it again from the packing node (or pack again there) and check it against the same digest"
    tar -tvf "$bundle" >"$work/members" 2>"$work/tar.err" ||
        die "$bundle cannot be read as a tar: $(cat "$work/tar.err")" "copy it again from the packing node"
    if grep -v '^[-d]' "$work/members" >"$work/odd"; then
        die "$bundle holds a member that is neither a file nor a folder (a symlink, a hard link or a device): $(sed -n 1p "$work/odd")" \
            "a bundle holds only files and folders: pack it again with channelsmith pack"
    fi
    mkdir "$work/bundle"
    tar -xf "$bundle" -C "$work/bundle" 2>"$work/tar.err" ||
        die "cannot extract $bundle into $work: $(cat "$work/tar.err")" \
            "free space in ${TMPDIR:-/tmp} (or point TMPDIR at a larger directory), then run it again"
    # The checked bundle's unpack.sh is the one that knows its layout; any other is refused.
    [ "$(sha256sum <"$0")" = "$(sha256sum <"$work/bundle/unpack.sh")" ] ||
        die "this unpack.sh ($0) is not the one inside $bundle" \
            "run the unpack.sh extracted from that bundle: tar -xf $bundle -C DIR && sh DIR/unpack.sh --bundle $bundle --sha256 HEX PREFIX"
    here=$work/bundle
fi
inputs=$here/channelsmith-unpack
lock=$here/channelsmith.lock
if [ ! -f "$here/pixi-pack.json" ] || [ ! -f "$inputs/files.tsv" ] || [ ! -f "$lock" ]; then
    die "$here is not an extracted channelsmith bundle (pixi-pack.json, channelsmith.lock or channelsmith-unpack/ missing)" \
        "extract the whole bundle first: tar -xf FILE.tar -C DIR, then sh DIR/unpack.sh --bundle FILE.tar --sha256 HEX PREFIX"
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


# .tar.bz2 packages (the older format) need bzip2 behind tar -j.
if grep -q '^P	.*\.tar\.bz2	' "$inputs/files.tsv" && ! command -v bzip2 >/dev/null 2>&1; then
    die "a package of this bundle is a .tar.bz2 file, and bzip2 is not on PATH" "install bzip2, then run it again"
fi
if grep -q '^B	' "$inputs/files.tsv"; then
    die "a package of this bundle needs binary prefix replacement, which unpack.sh does not do" \
        "install it with channelsmith deploy --bundle FILE.tar --prefix DIR, or pixi-unpack"
fi
tab=$(printf '\t')
# sed needs the placeholder as a pattern and the prefix as a replacement, both escaped.
escape_pattern() { printf '%s\n' "$1" | sed 's/[]\/$*.^[]/\\&/g'; }
escape_replacement() { printf '%s\n' "$1" | sed 's/[\/&]/\\&/g'; }

# The lock (rattler's format, as channelsmith deploy writes it): "SHA256 URL" for each package of its
# package list, and the URL of each package its default environment pins for a platform.
lock_sha256s() {
    url=
    while IFS= read -r line; do
        case $line in
            "- conda: "*) url=${line#- conda: } ;;
            "  sha256: "*) if [ -n "$url" ]; then printf '%s %s\n' "${line#  sha256: }" "$url"; fi ;;
            "  "*) ;;
            *) url= ;;
        esac
    done <"$1"
}
lock_pins() {
    in_default=0
    in_platform=0
    while IFS= read -r line; do
        case $line in
            "  default:") in_default=1 ;;
            "  "[!\ ]*) in_default=0 ;;
            "      $2:") in_platform=$in_default ;;
            "      - "*) if [ "$in_platform" -eq 1 ]; then printf '%s\n' "${line#      - }"; fi ;;
            *) in_platform=0 ;;
        esac
    done <"$1"
}

# Every package the lock pins for this platform is in the bundle with the sha256 the lock records, and
# the bundle installs no other. Checked before anything is written; each failure names the package.
lock_sha256s "$lock" >"$work/lock-sums"
lock_pins "$lock" "$bundle_platform" >"$work/pins"
[ -s "$work/pins" ] || die "the lock $lock pins no packages for $bundle_platform" \
    "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
: >"$work/sums"
while IFS= read -r pin; do
    case $pin in
        "conda: "*) url=${pin#conda: } ;;
        *) die "the lock $lock pins $pin, which is no conda package" "pack a lock channelsmith deploy wrote" ;;
    esac
    name=${url##*/}
    folder=${url%/*}
    archive=channel/${folder##*/}/$name
    grep -F -q "P$tab$archive$tab" "$inputs/files.tsv" ||
        die "the lock $lock pins $name, which the bundle's file list ($inputs/files.tsv) does not hold" \
            "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
    sum=$(sed -n "s/^\([0-9a-f]\{64\}\) $(escape_pattern "$url")\$/\1/p" "$work/lock-sums")
    [ -n "$sum" ] || die "the lock $lock records no sha256 for $name" "pack a lock channelsmith deploy wrote"
    printf '%s %s\n' "$sum" "$archive" >>"$work/sums"
done <"$work/pins"
grep "^P$tab" "$inputs/files.tsv" >"$work/packages"
while IFS=$tab read -r _kind archive _stem; do
    grep -F -q " $archive" "$work/sums" ||
        die "the bundle holds ${archive##*/}, which its lock $lock does not pin" \
            "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
done <"$work/packages"
while read -r sum archive; do
    name=${archive##*/}
    for part in channel "${archive%/*}" "$archive"; do
        [ ! -L "$here/$part" ] || die "$here/$part is a symlink: a bundle holds only files and folders" \
            "extract the bundle again from a good copy (tar -xf FILE.tar -C DIR), then run unpack.sh again"
    done
    [ -f "$here/$archive" ] || die "the package $name is missing from $here/${archive%/*}" \
        "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
    actual=$(sha256sum <"$here/$archive")
    actual=${actual%% *}
    [ "$actual" = "$sum" ] ||
        die "the package $name in $here differs from the sha256 its lock records ($actual, the lock says $sum)" \
            "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
done <"$work/sums"
if [ -z "$bundle" ]; then
    printf 'unpack.sh: note: %s\n%s\n' \
        "no --bundle/--sha256 given: the packages were checked against the bundle's own lock, which shows damage," \
        "  not a change; pass --bundle FILE.tar --sha256 HEX (FILE.tar.sha256) to check it against an outside digest" >&2
fi

started=1
mkdir -p "$prefix"

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
            # The script conda's and rattler's installers write for a noarch: python entry point. A
            # kernel reads a shebang up to a blank and at most 127 bytes: for a python path with a
            # space or over 125 bytes, rattler (PythonInfo::shebang) starts the script with /bin/sh,
            # which execs python on it; the same here.
            mkdir -p "$(dirname "$prefix/$a")"
            python_path=$prefix/$b
            case $python_path in
                *" "*) shebang_exec=1 ;;
                *) shebang_exec=0 ;;
            esac
            [ "${#python_path}" -le 125 ] || shebang_exec=1
            if [ "$shebang_exec" -eq 1 ]; then
                printf "#!/bin/sh\\n%s \"%s\" \"\$0\" \"\$@\" #%s\\n" "'''exec'" "$python_path" "'''" >"$prefix/$a"
            else
                printf '#!%s\n' "$python_path" >"$prefix/$a"
            fi
            cat >>"$prefix/$a" <<EOF
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
