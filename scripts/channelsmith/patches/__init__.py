"""Patch series: check them against real upstream source, port them to a new version, compile-check them.

One module per concern, each importing only the ones above it in this list:

- ``parsing``: a patch file's header and the files and hunks of its diff;
- ``series``: where series live (``patches/<project>/<version>/<series>/``);
- ``applying``: a patch list applied, strictly (no fuzz), to a scratch copy of an upstream tree;
- ``checking``: ``patches check``, a verdict per (recipe, series, version);
- ``porting``: ``patches port``, a series rebased onto another version;
- ``compiling``: ``patches compile-check``, the patched C++ units compiled against release headers.

The names below are what the command line, ``lint`` and the tests use.
"""

from channelsmith.patches.checking import FAILED, UNVERIFIABLE, VERIFIED, SeriesResult, check
from channelsmith.patches.compiling import COMPILED, SKIPPED, UnitResult, compile_check
from channelsmith.patches.parsing import PatchFile, parse_patch
from channelsmith.patches.porting import PortResult, port
from channelsmith.patches.series import SeriesRef, series_of

__all__ = [
    "COMPILED",
    "FAILED",
    "SKIPPED",
    "UNVERIFIABLE",
    "VERIFIED",
    "PatchFile",
    "PortResult",
    "SeriesRef",
    "SeriesResult",
    "UnitResult",
    "check",
    "compile_check",
    "parse_patch",
    "port",
    "series_of",
]
