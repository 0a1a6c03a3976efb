"""Every installed NCCL network plugin loads and exports a plugin symbol this environment's NCCL looks for.

Usage: python plugin_symbols.py [--nccl LIB] [--expect-net NAME] [PLUGIN ...]

NCCL dlopens a plugin library (RTLD_NOW | RTLD_LOCAL) and dlsyms ``ncclNetPlugin_v<N>`` for each
API version it knows, newest first: v8 to v5 in NCCL 2.21.5 (src/net.cc), v11 to v6 in 2.29.7 and
v12 to v6 in 2.30.7 (src/plugin/net/net_v<N>.cc). Those names are string literals in libnccl.so.2,
so this script reads them from the NCCL of the environment ($PREFIX/lib/libnccl.so.2 unless --nccl
names another), loads each plugin (default: $PREFIX/lib/libnccl-net*.so) the way NCCL does, and
requires at least one of them to resolve. The first one that resolves is the API NCCL will use; its
struct starts with the network's name (``const char* name`` in every version), which must be
NAME when --expect-net is given (NCCL compares names case-insensitively). aws-ofi-nccl 1.19.2
renames its network while it loads when NCCL_NET is "AWS Libfabric" or "OFI" (a constructor in
src/nccl_ofi_interface_nvidia.cpp), so the name read is the one NCCL sees in this environment.

Needs no GPU and no fabric: only the dynamic loader. Exit 0 when every plugin passes, 1 otherwise
(each failure is said on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
from pathlib import Path

# The linker may store a literal as the tail of a longer string that ends the same way, so only
# its end (the NUL) is anchored.
PLUGIN_SYMBOL = re.compile(rb"ncclNetPlugin_v(\d+)\x00")


def wanted_versions(nccl: Path) -> list[int]:
    """The ncclNetPlugin_v<N> versions ``nccl`` looks up, newest first (the order NCCL tries them)."""
    return sorted({int(v) for v in PLUGIN_SYMBOL.findall(nccl.read_bytes())}, reverse=True)


def check_plugin(plugin: Path, versions: list[int], expect_net: str | None) -> str | None:
    """None when ``plugin`` loads and exports one of ``versions`` (named as expected); else why not."""
    try:
        library = ctypes.CDLL(str(plugin), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as error:
        return f"does not load as NCCL loads it (RTLD_NOW): {error}"
    found = [v for v in versions if hasattr(library, f"ncclNetPlugin_v{v}")]
    if not found:
        others = [v for v in range(63, 0, -1) if hasattr(library, f"ncclNetPlugin_v{v}")]
        exported = ", ".join(f"ncclNetPlugin_v{v}" for v in others) or "no ncclNetPlugin_v<N> symbol"
        looked_for = ", ".join(f"ncclNetPlugin_v{v}" for v in versions)
        return f"exports {exported}; this NCCL looks only for {looked_for}"
    symbol = f"ncclNetPlugin_v{found[0]}"
    raw = ctypes.c_char_p.in_dll(library, symbol).value
    name = raw.decode(errors="replace") if raw is not None else ""
    print(f"plugin_symbols: {plugin}: NCCL will use {symbol} (network '{name}'); "
          f"it also resolves {', '.join(f'v{v}' for v in found[1:]) or 'no older version'}")
    if expect_net is not None and name.lower() != expect_net.lower():
        return f"{symbol} names the network '{name}', expected '{expect_net}'"
    return None


def main(argv: list[str] | None = None) -> int:
    """Check every plugin; print what NCCL will use; 0 when all pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nccl", type=Path, help="libnccl.so.2 to read (default: $PREFIX/lib/libnccl.so.2)")
    parser.add_argument("--expect-net", help="the network name each plugin must register")
    parser.add_argument("plugins", nargs="*", type=Path, help="plugin libraries (default: $PREFIX/lib/libnccl-net*.so)")
    args = parser.parse_args(argv)

    prefix = os.environ.get("PREFIX")
    if (args.nccl is None or not args.plugins) and not prefix:
        parser.error("set PREFIX or name --nccl and the plugin libraries")
    nccl = args.nccl or Path(prefix, "lib", "libnccl.so.2")
    plugins = args.plugins or sorted(Path(prefix, "lib").glob("libnccl-net*.so"))
    if not nccl.is_file():
        parser.error(f"no NCCL library at {nccl}")
    if not plugins:
        parser.error(f"no libnccl-net*.so under {Path(prefix, 'lib')}")

    versions = wanted_versions(nccl)
    if not versions:
        print(f"plugin_symbols: {nccl} names no ncclNetPlugin_v<N> symbol: not an NCCL library", file=sys.stderr)
        return 1
    print(f"plugin_symbols: {nccl} looks for " + ", ".join(f"ncclNetPlugin_v{v}" for v in versions))
    failures = 0
    for plugin in plugins:
        problem = check_plugin(plugin, versions, args.expect_net)
        if problem is not None:
            print(f"plugin_symbols: FAIL: {plugin}: {problem}", file=sys.stderr)
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
