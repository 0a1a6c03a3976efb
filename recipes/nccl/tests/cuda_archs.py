"""cuda_archs.py LIBRARY --expect LIST: the GPU code compiled into a shared library against a site's list.

LIST is the site's cuda_arch_list (TORCH_CUDA_ARCH_LIST syntax, as recipes/nccl/gencode.sh reads it):
"8.0;9.0+PTX" asks for SASS (a cubin) for sm_80 and sm_90 and PTX for compute_90. The library must
hold exactly that: every SASS architecture asked for in its linked image, PTX for each "+PTX" entry
and for no other, and no SASS of architectures nobody asked for. No CUDA tool is needed: the ELF's
fatbin sections are read directly.

  .nv_fatbin      the images the CUDA runtime registers: whole-program objects (nvcc -dw) and the
                  image that `nvcc -dlink` made from the relocatable ones (nvcc -dc). NCCL uses both.
  __nv_relfatbin  the relocatable objects' own fatbins: their cubins and their PTX. With -dc, PTX
                  is only here (seen with nvcc 13.0: the -dlink image holds cubins only).

Each fatbin starts with magic 0xBA55ED50, a 16-bit version, a 16-bit header size and a 64-bit size;
each entry of it with a 16-bit kind (1 PTX, 2 cubin), a 32-bit header size at offset 4, a 64-bit
payload size at offset 8 and the 32-bit SM number at offset 28 (layout read from nvcc 13.0's output:
tests/test_nccl_cuda_archs.py compiles a library with nvcc where one is installed and checks it).
Arch-specific targets (sm_90a, sm_100f) are compared by number: their flag bits are not documented.

Exit 0 when the library matches, 1 when it does not (each difference is named), 2 on bad input.
People read stderr; --json prints the architectures found on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
from pathlib import Path

FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
FATBIN_MAGIC = 0xBA55ED50
ENTRY_KINDS = {1: "ptx", 2: "sass"}
ARCH_ENTRY = re.compile(r"^(\d+)\.(\d)([af]?)(\+PTX)?$")

# NCCL >= 2.27's src/device/Makefile adds FP8 kernels for sm_100 whatever NVCC_GENCODE says:
# -gencode=arch=compute_100a,code=sm_100a from CUDA 12.7, compute_100f/sm_100f from CUDA 12.9
# (NVIDIA/nccl#2420). SASS for sm_100 is therefore allowed, never required, from CUDA 12.7 on.
FP8_EXTRA_SASS = 100
FP8_EXTRA_FROM_CUDA = (12, 7)


class BadInput(Exception):
    """The library or the list cannot be read."""


def elf_sections(data: bytes) -> dict[str, bytes]:
    """Name -> contents of every section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or len(data) < 6 or data[4] != 2 or data[5] != 1:
        raise BadInput("not a 64-bit little-endian ELF file")
    # A cut copy (a partial download, `head -c`) ends before what its header points at: say so, rather
    # than read past the end.
    if len(data) < 0x40:
        raise BadInput(f"truncated: {len(data)} bytes, fewer than the 64 of an ELF header")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize < 0x28 or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise BadInput(f"truncated or damaged: its section headers end at byte {shoff + shnum * shentsize}, "
                       f"the file has {len(data)} bytes")
    headers = []
    for index in range(shnum):
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + index * shentsize)
        # SHT_NOBITS (8) occupies no bytes in the file.
        if kind != 8 and offset + size > len(data):
            raise BadInput(f"truncated or damaged: a section ends at byte {offset + size}, "
                           f"the file has {len(data)} bytes")
        headers.append((name, kind, offset, size))
    names_offset = headers[shstrndx][2]
    sections = {}
    for name, kind, offset, size in headers:
        end = data.find(b"\0", names_offset + name)
        if end < 0:
            raise BadInput("damaged: a section name runs to the end of the file")
        sections[data[names_offset + name:end].decode(errors="replace")] = (
            b"" if kind == 8 else data[offset:offset + size])
    return sections


def fatbin_entries(section: bytes) -> list[tuple[str, int]]:
    """(kind, SM number) of every entry of every fatbin in a section (fatbins are 8-byte aligned)."""
    entries = []
    position = 0
    while position + 16 <= len(section):
        magic, _version, header_size, size = struct.unpack_from("<IHHQ", section, position)
        if magic != FATBIN_MAGIC:
            position += 8
            continue
        entry = position + header_size
        end = entry + size
        while entry + 32 <= min(end, len(section)):
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", section, entry)
            (arch,) = struct.unpack_from("<I", section, entry + 28)
            if kind in ENTRY_KINDS:
                entries.append((ENTRY_KINDS[kind], arch))
            if entry_header == 0:
                break
            entry += entry_header + payload
        position = max(end, position + 8)
    return entries


def found_archs(library: Path) -> dict[str, dict[str, list[int]]]:
    """Section -> {"sass": [...], "ptx": [...]} for each fatbin section the library has."""
    try:
        data = library.read_bytes()
    except OSError as exc:
        raise BadInput(f"cannot read {library}: {exc.strerror}") from None
    try:
        sections = elf_sections(data)
    except BadInput as exc:
        raise BadInput(f"{library} is {exc}") from None
    found = {}
    for name in FATBIN_SECTIONS:
        if name in sections:
            entries = fatbin_entries(sections[name])
            found[name] = {kind: sorted({arch for k, arch in entries if k == kind}) for kind in ("sass", "ptx")}
    if not found:
        raise BadInput(f"{library} has no {' or '.join(FATBIN_SECTIONS)} section: it holds no GPU code")
    return found


def expected_archs(arch_list: str) -> tuple[set[int], set[int]]:
    """(SASS, PTX) SM numbers a cuda_arch_list asks for."""
    sass, ptx = set(), set()
    for entry in re.split(r"[;, ]+", arch_list.strip()):
        if not entry:
            continue
        match = ARCH_ENTRY.match(entry)
        if not match:
            raise BadInput(f"'{entry}' is not a CUDA architecture like 8.0, 9.0a or 9.0+PTX")
        number = int(match.group(1) + match.group(2))
        sass.add(number)
        if match.group(4):
            ptx.add(number)
    if not sass:
        raise BadInput("the cuda_arch_list is empty")
    return sass, ptx


def allowed_extra_sass(cuda_version: str | None) -> set[int]:
    """SASS the build adds on its own (NCCL's sm_100 FP8 kernels from CUDA 12.7 on)."""
    if not cuda_version:
        return set()
    match = re.match(r"^(\d+)\.(\d+)", cuda_version)
    if not match:
        raise BadInput(f"--cuda-version {cuda_version!r} is not like 12.4")
    return {FP8_EXTRA_SASS} if (int(match.group(1)), int(match.group(2))) >= FP8_EXTRA_FROM_CUDA else set()


def differences(found: dict[str, dict[str, list[int]]], arch_list: str, cuda_version: str | None) -> list[str]:
    """What differs from the list, one sentence each (empty when the library matches)."""
    want_sass, want_ptx = expected_archs(arch_list)
    linked = set(found.get(".nv_fatbin", {}).get("sass", []))
    sass = {a for kinds in found.values() for a in kinds["sass"]}
    ptx = {a for kinds in found.values() for a in kinds["ptx"]}
    problems = []
    for arch in sorted(want_sass - linked):
        problems.append(f"no sm_{arch} SASS in .nv_fatbin, though the list asks for {arch // 10}.{arch % 10}: "
                        "such a GPU finds no kernel image")
    for arch in sorted(sass - want_sass - allowed_extra_sass(cuda_version)):
        problems.append(f"sm_{arch} SASS that the list does not ask for (NVCC_GENCODE not taken from the list?)")
    for arch in sorted(want_ptx - ptx):
        problems.append(f"no compute_{arch} PTX, though the list says {arch // 10}.{arch % 10}+PTX: "
                        "GPUs newer than the list cannot JIT-compile NCCL's kernels")
    for arch in sorted(ptx - want_ptx):
        problems.append(f"compute_{arch} PTX that the list does not ask for (no +PTX on {arch // 10}.{arch % 10})")
    return problems


def resolve(library: str) -> Path:
    """LIBRARY as given, or relative to the environment ($PREFIX, else $CONDA_PREFIX) when relative."""
    path = Path(library)
    root = os.environ.get("PREFIX") or os.environ.get("CONDA_PREFIX")
    return path if path.is_absolute() or root is None else Path(root) / path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", help="shared library, absolute or relative to $PREFIX")
    parser.add_argument("--expect", required=True, help='the site\'s cuda_arch_list, e.g. "8.0;9.0+PTX"')
    parser.add_argument("--cuda-version",
                        help="CUDA the library was built with (allows NCCL's own sm_100 kernels from 12.7)")
    parser.add_argument("--json", action="store_true", help="print what was found as JSON on stdout")
    args = parser.parse_args(argv)
    library = resolve(args.library)
    try:
        found = found_archs(library)
        problems = differences(found, args.expect, args.cuda_version)
    except BadInput as exc:
        print(f"cuda_archs: {exc}", file=sys.stderr)
        return 2
    for section, kinds in found.items():
        print(f"cuda_archs: {library.name} {section}: SASS {kinds['sass']}, PTX {kinds['ptx']}", file=sys.stderr)
    if args.json:
        print(json.dumps({"library": str(library), "expect": args.expect, "sections": found, "problems": problems}))
    for problem in problems:
        print(f"cuda_archs: FAIL {problem}", file=sys.stderr)
    if not problems:
        print(f"cuda_archs: OK, the GPU code matches cuda_arch_list {args.expect}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
