#!/bin/sh
# unpack.sh cannot vouch for itself: it comes from the bundle it installs, and a changed bundle can carry
# a changed unpack.sh that checks nothing. So check the bundle first, with what the site already trusts
# and on a private copy, and only then run this script from that copy (docs/howto/air-gap.md, step 3'):
#
#   B=$(mktemp -d) && cp env.tar "$B" && cd "$B" || exit 2   # a private copy (0700): no one can swap it
#   sha256sum -c ANCHORS/env.tar.sha256 || exit 2     # or: ssh-keygen -Y verify -f SIGNERS -I PRINCIPAL \
#                                                     #   -n channelsmith-bundle -s ANCHORS/env.tar.sig <env.tar
#   tar -xf env.tar unpack.sh && sh unpack.sh --bundle env.tar --sha256 HEX PREFIX && . PREFIX/activate.sh
#
# (With --allowed-signers SIGNERS --signature ANCHORS/env.tar.sig instead of --sha256 HEX for a signed
# bundle.) Where channelsmith is installed, `channelsmith deploy --bundle` is the route to take.
# The anchors (HEX, env.tar.sha256, the site's signers file) travel apart from the bundle. This script
# checks them again itself: it copies the bundle once into a private folder (mode 0700), then hashes,
# lists and extracts that one copy, so the bytes checked are the bytes installed even if the original
# is swapped meanwhile. Every package is checked against the sha256 the lock records. Without
# --bundle, that lock is the extracted one, which shows damage, not a change: whoever changed a
# package could have changed the lock too (docs/explain/air-gap-trust.md says what each route proves).
# CHANNELSMITH_REQUIRE_ANCHOR=1 refuses a bundle given with no anchor. --json prints a one-line report
# on stdout (prefix, packages, the anchor checked: signature, sha256, both joined by "+", or none).
#
# Needs a POSIX shell and utilities (cat chmod cp df dirname grep id ls mkdir rm sed uname wc; head, mktemp) plus what the
# .conda format needs: unzip (a .conda file is a zip) and zstd (holding zstd-compressed tars), tar,
# and sha256sum (coreutils) to check every package against the lock before anything is written;
# bzip2 too when the bundle holds .tar.bz2 packages; ssh-keygen (OpenSSH >= 8.2) with --allowed-signers.
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

usage="usage: sh unpack.sh [--bundle FILE.tar (--sha256 HEX | --allowed-signers FILE [--signature FILE.sig])] [--json] PREFIX"
usage_hint="PREFIX is a new or empty directory; HEX is the bundle's sha256 that channelsmith pack printed"
bundle=
digest=
signers=
signature=
json=0
target=
after_digest=0
while [ "$#" -gt 0 ]; do
    case $1 in
        --bundle | --sha256 | --allowed-signers | --signature)
            if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value; $usage" "$usage_hint"; fi
            case $1 in
                --bundle) bundle=$2 ;;
                --sha256) digest=$2 ;;
                --allowed-signers) signers=$2 ;;
                --signature) signature=$2 ;;
            esac
            after_digest=0
            if [ "$1" = --sha256 ]; then after_digest=1; fi
            shift 2
            ;;
        --json)
            json=1
            after_digest=0
            shift
            ;;
        -*) die "unknown option $1; $usage" "$usage_hint" ;;
        *)
            # `--sha256 $(cat FILE.tar.sha256)` unquoted: the line's second word (the bundle's name) arrives here.
            case $after_digest$1 in
                1*.tar) die "--sha256 $digest is followed by '$1', the second word of FILE.tar.sha256: --sha256 takes the digest alone" \
                    "pass its first word only: --sha256 \"\$(cut -d' ' -f1 FILE.tar.sha256)\"" ;;
            esac
            [ -z "$target" ] || die "two prefixes given ($target and $1); $usage" "$usage_hint"
            target=$1
            after_digest=0
            shift
            ;;
    esac
done
[ -n "$target" ] || die "no PREFIX given; $usage" "$usage_hint"
if [ -n "$bundle" ] && [ -z "$digest" ] && [ -z "$signers" ]; then
    die "--bundle needs --sha256 or --allowed-signers: the bundle file proves nothing without an anchor kept apart from it" "$usage_hint"
fi
if [ -z "$bundle" ] && { [ -n "$digest" ] || [ -n "$signers" ]; }; then
    die "--sha256 and --allowed-signers need --bundle FILE.tar: they vouch for the bundle file, which unpack.sh checks and extracts" \
        "pass the tar you extracted this folder from: --bundle FILE.tar --sha256 HEX"
fi
if [ -n "$signature" ] && [ -z "$signers" ]; then
    die "--signature is checked against a signers file; it takes --allowed-signers" "pass --allowed-signers FILE too"
fi
case ${CHANNELSMITH_REQUIRE_ANCHOR:-} in
    '' | 0 | 1) ;;
    *) die "CHANNELSMITH_REQUIRE_ANCHOR=$CHANNELSMITH_REQUIRE_ANCHOR is neither 1 nor 0" \
        "set CHANNELSMITH_REQUIRE_ANCHOR=1 to refuse bundles with no outside anchor, or 0 (or unset it) to allow them" ;;
esac
if [ -z "$bundle" ] && [ "${CHANNELSMITH_REQUIRE_ANCHOR:-}" = 1 ]; then
    die "no outside anchor given, and CHANNELSMITH_REQUIRE_ANCHOR=1 refuses such bundles" \
        "pass --bundle FILE.tar with --sha256 HEX (FILE.tar.sha256, carried apart from the bundle) or --allowed-signers FILE"
fi
tools="cat chmod cp df dirname grep head id ls mkdir mktemp rm sed uname wc tar unzip zstd sha256sum"
if [ -n "$signers" ]; then tools="$tools ssh-keygen"; fi
for tool in $tools; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "unpack.sh needs $tool, which is not on PATH" \
            "install $tool (Debian: unzip, zstd, tar, coreutils, sed, grep, openssh-client), or use deploy --bundle or pixi-unpack"
done

# Case and surrounding blanks do not matter (as for channelsmith deploy --sha256).
digest=$(printf '%s\n' "$digest" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//; y/ABCDEF/abcdef/')
case $digest in
    *[[:space:]]*) die "--sha256 '$digest' is a whole line of FILE.tar.sha256, not the digest alone" \
        "pass its first word only: --sha256 \"\$(cut -d' ' -f1 FILE.tar.sha256)\"" ;;
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

here=$(cd "$(dirname "$0")" && pwd)
self_sum=$(sha256sum <"$0")
if [ -n "$bundle" ]; then
    [ -f "$bundle" ] || die "bundle $bundle does not exist" "pass the FILE.tar channelsmith pack wrote"
    [ -r "$bundle" ] || die "bundle $bundle cannot be read" "check that you can read it"
    if [ -n "$signers" ]; then
        [ -f "$signers" ] || die "--allowed-signers $signers does not exist" \
            "pass the site's signers file (ssh-keygen's allowed-signers format: PRINCIPAL KEYTYPE KEY per line)"
        signature=${signature:-$bundle.sig}
        [ -f "$signature" ] || die "$bundle is unsigned: its signature $signature does not exist" \
            "do not install it: fetch FILE.tar.sig from where the packer put it (pack --sign KEY) and pass --signature FILE.sig"
        for given in "$signers" "$signature"; do [ -r "$given" ] || die "cannot read $given" "check that you can read it"; done
        exec 7<"$signers" 8<"$signature"
    fi
    # Opened before the scratch folder is entered (below): names are found from the folder this runs in.
    exec 9<"$bundle"
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/channelsmith-unpack.XXXXXX") ||
    die "cannot create a temporary directory in ${TMPDIR:-/tmp}" "point TMPDIR at a writable directory with free space"
started=0
finished=0
cleanup() {
    status=$?
    cd / && rm -rf "$scratch"
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
# The scratch folder is entered and read as "." from here on: whoever can write TMPDIR (a shared one, mode
# 0777 without the sticky bit, or another user's) can rename the folder mktemp made and put their own in its
# place, but cannot change the folder this shell is in. Refused unless that folder is this user's alone.
cd "$scratch" || die "cannot enter $scratch" "point TMPDIR at a folder only you can write"
# shellcheck disable=SC2046 # the words of ls's line, on purpose
set -- $(ls -ldn .)
case $1:$3 in
    "drwx------:$(id -u)" | "drwx------.:$(id -u)") ;; # '.': an SELinux context; an ACL ('+') is refused
    *) die "$scratch is not a folder of yours alone ($1, owner uid $3): another user can write ${TMPDIR:-/tmp} and put their own folder where mktemp made yours" \
        "point TMPDIR at a folder only you can write (mkdir -m 700 -p ~/tmp && export TMPDIR=~/tmp), then run it again" ;;
esac
work=.

# All lines of a command's messages, joined (ssh-keygen says why, such as an expired key, before its last line).
messages() {
    joined=
    while IFS= read -r line; do
        if [ -n "$line" ]; then joined="${joined:+$joined; }$line"; fi
    done <"$1"
    printf '%s' "${joined:-no message}"
}

anchor=none
signer=
shown=$here
if [ -n "$bundle" ]; then
    # The one read of the bundle: a private copy, which is then hashed, listed and extracted. Reading the
    # original three times let a swap between the reads install other bytes. cat from the file opened above:
    # one open file, read to its end whatever is renamed over the name meanwhile.
    cat <&9 >"$work/bundle.tar" 2>"$work/cp.err" ||
        die "cannot copy $bundle into $scratch: $(messages "$work/cp.err")" \
            "check that you can read it, and free space in ${TMPDIR:-/tmp} (or point TMPDIR at a larger folder only you can write)"
    exec 9<&-
    copy=$work/bundle.tar
    if [ -n "$signers" ]; then
        if ! cat <&7 >"$work/signers" || ! cat <&8 >"$work/bundle.sig"; then
            die "cannot copy $signers and $signature into $scratch" "check that you can read them"
        fi
        exec 7<&- 8<&-
        ssh-keygen -Y find-principals -f "$work/signers" -s "$work/bundle.sig" >"$work/principals" 2>"$work/ssh.err" ||
            die "$bundle's signature $signature is by no key that $signers lists ($(messages "$work/ssh.err"))" \
                "do not install this bundle: it was not signed by anyone the site trusts; ask for one signed with a key in the signers file"
        signer=$(sed -n 1p "$work/principals")
        ssh-keygen -Y verify -f "$work/signers" -I "$signer" -n channelsmith-bundle -s "$work/bundle.sig" \
            <"$copy" >"$work/ssh.err" 2>&1 ||
            die "$bundle does not match its signature $signature by $signer ($(messages "$work/ssh.err")): it is not the bundle that was signed" \
                "do not install it: copy it again from the packing node (or pack and sign it again there) and check it against the same signers file"
        anchor=signature
    fi
    if [ -n "$digest" ]; then
        actual=$(sha256sum <"$copy") || die "cannot read $copy" "free space in ${TMPDIR:-/tmp}, then run it again"
        actual=${actual%% *}
        [ "$actual" = "$digest" ] ||
            die "$bundle has the sha256 $actual, not the $digest given with --sha256: it is not the bundle that was packed (damaged or changed on the way)" \
                "do not install it: copy it again from the packing node (or pack again there) and check it against the same digest"
        if [ "$anchor" = none ]; then anchor=sha256; else anchor=$anchor+sha256; fi
    fi
    tar -tvf "$copy" >"$work/members" 2>"$work/tar.err" ||
        die "$bundle cannot be read as a tar: $(messages "$work/tar.err")" "copy it again from the packing node"
    if grep -v '^[-d]' "$work/members" >"$work/odd"; then
        die "$bundle holds a member that is neither a file nor a folder (a symlink, a hard link or a device): $(sed -n 1p "$work/odd")" \
            "a bundle holds only files and folders: pack it again with channelsmith pack"
    fi
    # GNU tar would strip a leading / and refuse ..; a bundle holds neither (as deploy --bundle requires).
    tar -tf "$copy" >"$work/names" 2>"$work/tar.err" ||
        die "$bundle cannot be read as a tar: $(messages "$work/tar.err")" "copy it again from the packing node"
    if grep -E '^/|(^|/)\.\.(/|$)' "$work/names" >"$work/odd"; then
        die "$bundle holds $(sed -n 1p "$work/odd"), a path outside the bundle" \
            "do not install it: a bundle channelsmith pack writes holds only relative paths; pack it again there"
    fi
    mkdir "$work/bundle"
    tar -xf "$copy" -C "$work/bundle" 2>"$work/tar.err" ||
        die "cannot extract $bundle into $scratch: $(messages "$work/tar.err")" \
            "free space in ${TMPDIR:-/tmp} (or point TMPDIR at a larger folder only you can write), then run it again"
    rm -f "$copy"
    # The checked bundle's unpack.sh is the one that knows its layout; any other is refused.
    [ "$self_sum" = "$(sha256sum <"$work/bundle/unpack.sh")" ] ||
        die "this unpack.sh ($0) is not the one inside $bundle" \
            "check the bundle first, then run the unpack.sh inside it: tar -xf $bundle unpack.sh && sh unpack.sh --bundle $bundle --sha256 HEX PREFIX"
    here=$work/bundle
    shown=$scratch/bundle # for messages; read as ./bundle
fi
inputs=$here/channelsmith-unpack
lock=$here/channelsmith.lock
lock_shown=$lock
if [ -n "$bundle" ]; then lock_shown=$shown/channelsmith.lock; fi
if [ ! -f "$here/pixi-pack.json" ] || [ ! -f "$inputs/files.tsv" ] || [ ! -f "$lock" ]; then
    die "$here is not an extracted channelsmith bundle (pixi-pack.json, channelsmith.lock or channelsmith-unpack/ missing)" \
        "pass the checked tar it came from: sh unpack.sh --bundle FILE.tar --sha256 HEX PREFIX (docs/howto/air-gap.md, step 3')"
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
[ -s "$work/pins" ] || die "the lock $lock_shown pins no packages for $bundle_platform" \
    "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
: >"$work/sums"
while IFS= read -r pin; do
    case $pin in
        "conda: "*) url=${pin#conda: } ;;
        *) die "the lock $lock_shown pins $pin, which is no conda package" "pack a lock channelsmith deploy wrote" ;;
    esac
    name=${url##*/}
    folder=${url%/*}
    archive=channel/${folder##*/}/$name
    grep -F -q "P$tab$archive$tab" "$inputs/files.tsv" ||
        die "the lock $lock_shown pins $name, which the bundle's file list ($inputs/files.tsv) does not hold" \
            "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
    sum=$(sed -n "s/^\([0-9a-f]\{64\}\) $(escape_pattern "$url")\$/\1/p" "$work/lock-sums")
    [ -n "$sum" ] || die "the lock $lock_shown records no sha256 for $name" "pack a lock channelsmith deploy wrote"
    printf '%s %s\n' "$sum" "$archive" >>"$work/sums"
done <"$work/pins"
grep "^P$tab" "$inputs/files.tsv" >"$work/packages"
while IFS=$tab read -r _kind archive _stem; do
    grep -F -q " $archive" "$work/sums" ||
        die "the bundle holds ${archive##*/}, which its lock $lock_shown does not pin" \
            "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
done <"$work/packages"
while read -r sum archive; do
    name=${archive##*/}
    for part in channel "${archive%/*}" "$archive"; do
        [ ! -L "$here/$part" ] || die "$shown/$part is a symlink: a bundle holds only files and folders" \
            "extract the bundle again from a good copy (tar -xf FILE.tar -C DIR), then run unpack.sh again"
    done
    [ -f "$here/$archive" ] || die "the package $name is missing from $shown/${archive%/*}" \
        "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
    actual=$(sha256sum <"$here/$archive")
    actual=${actual%% *}
    [ "$actual" = "$sum" ] ||
        die "the package $name in $shown differs from the sha256 its lock records ($actual, the lock says $sum)" \
            "extract the bundle again from a good copy (or pack it again), then run unpack.sh again"
done <"$work/sums"
# Every package's payload decompresses to no more than the bound pack measured from its info/paths.json (the
# file list's P lines): counted, writing nothing, before anything is extracted, so that a package that holds
# more than it records (gigabytes of zeros compress to kilobytes) is refused instead of filling the disk.
payload_bytes() { # archive, stem, bound -> the payload tar's bytes, counted up to one past the bound
    case $1 in
        *.conda) unzip -p "$1" "pkg-$2.tar.zst" 2>"$work/unpack.err" | zstd -q -dc 2>>"$work/unpack.err" |
            head -c "$(($3 + 1))" | wc -c ;;
        *) bzip2 -dc <"$1" 2>"$work/unpack.err" | head -c "$(($3 + 1))" | wc -c ;;
    esac
}
total=0
largest=0
while IFS=$tab read -r _kind archive stem bound; do
    case $bound in
        '' | *[!0-9]*) die "the bundle's file list ($inputs/files.tsv) gives no size bound for ${archive##*/}" \
            "pack the bundle again with a channelsmith that writes one (this unpack.sh came with the bundle)" ;;
    esac
    expanded=$(($(payload_bytes "$here/$archive" "$stem" "$bound")))
    [ "$expanded" -le "$bound" ] ||
        die "the package ${archive##*/} expands past what it records: its payload decompresses to more than $bound bytes, the most its info/paths.json allows (counted without writing it); nothing was installed (a decompression bomb, or a package damaged before it was hashed)" \
            "do not install this bundle: rebuild the package (or take it again from a good channel), then pack again"
    total=$((total + bound))
    if [ "$bound" -gt "$largest" ]; then largest=$bound; fi
done <"$work/packages"
# Room, by those bounds: the scratch folder holds every payload extracted and one payload tar at a time; the
# prefix a copy of every payload (the same room again where both are on one file system). df -P's line:
# FILESYSTEM BLOCKS USED AVAILABLE CAPACITY% MOUNTPOINT, in KiB with -k.
free_kib() { df -P -k "$1" 2>/dev/null | sed -n '2s/^.* \([0-9][0-9]*\)  *[0-9][0-9]*%  *\/.*$/\1/p'; }
mount_of() { df -P -k "$1" 2>/dev/null | sed -n '2s/^.* [0-9][0-9]*%  *\(\/.*\)$/\1/p'; }
room_at=$(dirname "$top")
scratch_kib=$(((total + largest + 1023) / 1024))
prefix_kib=$(((total + 1023) / 1024))
if [ "$(mount_of .)" = "$(mount_of "$room_at")" ]; then
    scratch_kib=$((scratch_kib + prefix_kib))
    prefix_kib=0
fi
check_room() { # folder to ask df about, KiB needed there, the folder as messages show it
    [ "$2" -gt 0 ] || return 0
    free=$(free_kib "$1")
    if [ -z "$free" ]; then
        printf 'unpack.sh: note: df -P -k %s says no free space unpack.sh can read; room for %s KiB not checked\n' \
            "$3" "$2" >&2
    elif [ "$2" -gt "$free" ]; then
        die "the packages need $2 KiB in $3 (their payloads as their info/paths.json records them, extracted and copied into the prefix), and it has $free KiB free: nothing was installed" \
            "check free space (df -h $3): free some there, or point TMPDIR or the prefix at a larger file system"
    fi
}
check_room . "$scratch_kib" "$scratch"
check_room "$room_at" "$prefix_kib" "$room_at"
if [ -z "$bundle" ]; then
    printf 'unpack.sh: note: %s\n%s\n' \
        "no --bundle/--sha256 given: the packages were checked against the bundle's own lock, which shows damage," \
        "  not a change; pass --bundle FILE.tar --sha256 HEX (or --allowed-signers FILE) to check it against an outside anchor" >&2
fi

started=1
mkdir -p "$prefix"

replacement=$(escape_replacement "$prefix")

unpacking_failed() { # archive: a package that matches its lock's sha256 and still does not unpack
    status=$? # of the command that failed
    why=$(messages "$work/unpack.err")
    if [ "$why" = "no message" ]; then
        why="it exited $status with no message, as on a full disk (df -h $scratch)"
    fi
    die "cannot unpack the package ${1##*/}: $why" \
        "its sha256 matches the bundle's lock, so it was damaged before packing or changed together with that lock: do not use this bundle; copy it again from the packing node and check it against its anchor, or pack it again (if the message says no space is left, free space in ${TMPDIR:-/tmp} instead)"
}

unpack_package() { # archive, stem -> the package's files under $work/$stem
    mkdir -p "$work/$2"
    case $1 in
        *.conda)
            unzip -q -o "$1" "pkg-$2.tar.zst" -d "$work/$2.zip" >"$work/unpack.err" 2>&1 || unpacking_failed "$1"
            zstd -q -d -f "$work/$2.zip/pkg-$2.tar.zst" -o "$work/$2.tar" 2>"$work/unpack.err" || unpacking_failed "$1"
            tar -xf "$work/$2.tar" -C "$work/$2" 2>"$work/unpack.err" || unpacking_failed "$1"
            rm -rf "$work/$2.zip" "$work/$2.tar"
            ;;
        *.tar.bz2) tar -xjf "$1" -C "$work/$2" 2>"$work/unpack.err" || unpacking_failed "$1" ;;
        *) die "$1 is not a .conda or .tar.bz2 package" "pack the bundle again with channelsmith pack" ;;
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
printf 'unpack.sh: installed %s packages into %s (outside anchor checked: %s%s); activate with: . %s/activate.sh\n' \
    "$count" "$prefix" "$anchor" "${signer:+, signed by $signer}" "$prefix" >&2
if [ "$json" -eq 1 ]; then
    # The prefix holds no quote, backslash, tab or newline (refused above); the signer may: escaped.
    signer_json=null
    if [ -n "$signer" ]; then signer_json="\"$(printf '%s' "$signer" | sed 's/[\\"]/\\&/g')\""; fi
    printf '{"prefix": "%s", "packages": %s, "anchor": "%s", "signer": %s}\n' "$prefix" "$count" "$anchor" "$signer_json"
fi
