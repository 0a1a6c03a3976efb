"""Environment checks: PyTorch build, the NCCL library really loaded, NCCL's network, MPI.

``torch.cuda.nccl.version()`` reflects the NCCL headers PyTorch was compiled against, not the
library the process loaded; the loaded one is found in /proc/self/maps and asked through ctypes.
NCCL names the network (and plugin) it picked only in its own INFO log, so the ranks capture that
log into a file (NCCL_DEBUG_FILE) and :func:`nccl_network_check` reads it after NCCL has run.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_dist_check.report.results import FAIL, PASS, SKIPPED, CheckResult

NCCL_LOG_ENV = "TORCH_DIST_CHECK_NCCL_LOG"


def loaded_libraries(pattern: str, maps_text: str | None = None) -> list[str]:
    """Paths of mapped shared objects whose file name matches ``pattern`` (a regex), in map order."""
    if maps_text is None:
        maps_text = Path("/proc/self/maps").read_text()
    seen: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5].strip()
            if re.search(pattern, os.path.basename(path)) and path not in seen:
                seen.append(path)
    return seen


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE to (major, minor, patch): X*10000+Y*100+Z from 2.9 on, X*1000+Y*100+Z before."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def nccl_version_of(library: str) -> tuple[int, int, int]:
    """Ask a libnccl for its version through ncclGetVersion."""
    lib = ctypes.CDLL(library)
    value = ctypes.c_int(0)
    status = lib.ncclGetVersion(ctypes.byref(value))
    if status != 0:
        raise OSError(f"ncclGetVersion returned {status}")
    return decode_nccl_version(value.value)


def loaded_nccl_version() -> tuple[int, int, int] | None:
    """The version of the libnccl this process loaded, else the headers torch was built with, else None.

    A statically linked NCCL (no libnccl.so mapped) is the build version.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available() or not torch.cuda.is_available():
        return None
    torch.cuda.init()
    paths = loaded_libraries(r"^libnccl\.so")
    if paths:
        try:
            return nccl_version_of(paths[0])
        except OSError:  # no usable ncclGetVersion: the build headers are the best answer left
            pass
    build = tuple(torch.cuda.nccl.version()[:3])
    return (int(build[0]), int(build[1]), int(build[2]))


def torch_check() -> CheckResult:
    """The PyTorch version, build configuration and which distributed backends it has."""
    import torch
    import torch.distributed as dist

    details: dict[str, Any] = {
        "torch_version": torch.__version__,
        "git_version": getattr(torch.version, "git_version", None),
        "cuda_build": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "build_config": torch.__config__.show(),
        "library": os.path.dirname(torch.__file__),
    }
    if not dist.is_available():
        return CheckResult("env/torch", FAIL, "torch.distributed is not available in this build", details)
    names = [name for name, ok in details["backends"].items() if ok]
    summary = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, backends: {', '.join(names)}"
    return CheckResult("env/torch", PASS, summary, details)


def nccl_library_check(expect_version: str | None, expect_under: str | None) -> CheckResult:
    """Which libnccl the process loaded, its version, and how it compares with torch's build headers."""
    import torch
    import torch.distributed as dist

    name = "env/nccl-library"
    if not dist.is_nccl_available():
        return CheckResult.skipped(name, "PyTorch was built without NCCL")
    if not torch.cuda.is_available():
        return CheckResult.skipped(name, "no CUDA device is visible")
    torch.cuda.init()
    build = tuple(torch.cuda.nccl.version()[:3])
    details: dict[str, Any] = {"build_headers_version": ".".join(map(str, build))}
    paths = loaded_libraries(r"^libnccl\.so")
    if not paths:
        details["loaded_path"] = None
        reason = (
            "no libnccl.so is mapped: NCCL is linked statically into libtorch_cuda (the bundled copy), "
            "so the loaded version is the build version"
        )
        if expect_under:
            return CheckResult(name, FAIL, reason + f"; expected a libnccl under {expect_under}", details)
        return CheckResult(name, PASS, reason, details)
    path = paths[0]
    loaded = nccl_version_of(path)
    details.update(
        loaded_path=path,
        loaded_realpath=os.path.realpath(path),
        loaded_version=".".join(map(str, loaded)),
        all_mapped=paths,
    )
    problems: list[str] = []
    if loaded[:2] < build[:2]:
        problems.append(f"loaded NCCL {details['loaded_version']} is older than the headers torch was built with")
    if expect_version and details["loaded_version"] != expect_version:
        problems.append(f"loaded NCCL {details['loaded_version']}, expected {expect_version}")
    if expect_under:
        root = os.path.realpath(expect_under)
        if not os.path.realpath(path).startswith(root.rstrip("/") + "/"):
            problems.append(f"loaded {os.path.realpath(path)}, expected a libnccl under {root}")
    if len(paths) > 1:
        problems.append(f"{len(paths)} different libnccl files are mapped: {', '.join(paths)}")
    if problems:
        return CheckResult(name, FAIL, "; ".join(problems), details)
    same = "same as" if loaded == build else "differs from"
    return CheckResult(
        name, PASS, f"loaded {path} (NCCL {details['loaded_version']}; {same} build headers {details['build_headers_version']})", details
    )


def enable_nccl_log_capture(env: MutableMapping[str, str], run_dir: str | None = None) -> str | None:
    """Send NCCL's INFO log of this process to a file, unless the user already redirected it.

    Must run before NCCL initialises (NCCL reads these variables once). Returns the file pattern, or
    None when the user's own NCCL_DEBUG_FILE is kept (then the network check reads that instead,
    if NCCL_DEBUG is INFO).
    """
    if "NCCL_DEBUG_FILE" in env:
        return None
    folder = run_dir or tempfile.mkdtemp(prefix="torch-dist-check-nccl-")
    pattern = os.path.join(folder, "nccl.%h.%p.log")
    env["NCCL_DEBUG"] = "INFO"
    env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET,ENV")
    env["NCCL_DEBUG_FILE"] = pattern
    env[NCCL_LOG_ENV] = pattern
    return pattern


def drop_nccl_logs(folder: str, keep: bool) -> None:
    """Remove the folder :func:`enable_nccl_log_capture` made, once the run is over; with ``keep`` (a run that
    did not pass) leave it, and say where it is, if NCCL wrote anything into it."""
    try:
        written = os.listdir(folder)
    except OSError:
        return
    if keep and written:
        print(f"torch_dist_check: NCCL's logs of this run are kept in {folder}", file=sys.stderr)
        return
    shutil.rmtree(folder, ignore_errors=True)


# The networks built into NCCL (net_ib.cc and net_socket.cc name themselves so); any other name
# comes from an external plugin.
BUILTIN_NETWORKS = ("IB", "Socket")
# NCCL's INFO lines when a network plugin could not be opened or used: "Could not find:" and
# "<lib>: <dlerror>" (2.22 on), "is unsupported" and "Failed to initialize NET plugin" (2.28 on),
# "No plugin found" and "Plugin load returned" (2.21).
_PLUGIN_FAILURE = re.compile(
    r"NET/Plugin: (Could not find:|No plugin found|Plugin load returned|\S+\.so: )"
    r"|External network plugin \S+ is unsupported|Failed to initialize NET plugin"
)
# NCCL's INFO lines when it loaded one: the file from 2.28 on, the network's name in every release.
_PLUGIN_LOADED = re.compile(r"Successfully loaded external network plugin (\S+)|NET/Plugin: Loaded net plugin (.+?) \(v\d+\)")


@dataclass(frozen=True)
class NcclLogFacts:
    """What NCCL's own INFO log says about the library and network it used."""

    version_line: str | None
    networks: tuple[str, ...]
    plugin_lines: tuple[str, ...]
    warnings: tuple[str, ...]
    plugin_loaded: tuple[str, ...] = ()
    plugin_failures: tuple[str, ...] = ()


def parse_nccl_log(text: str) -> NcclLogFacts:
    """Pull the version, the network(s) NCCL chose, plugin loading lines and warnings from its log."""
    version = None
    networks: list[str] = []
    plugin: list[str] = []
    warnings: list[str] = []
    loaded: list[str] = []
    failures: list[str] = []
    for line in text.splitlines():
        message = line.split("NCCL INFO", 1)[-1].strip()
        if "NCCL version" in line and version is None:
            version = line.split("NCCL version", 1)[1].strip()
        match = re.search(r"Using network (.+?)\s*$", line)
        if match and match.group(1) not in networks:
            networks.append(match.group(1))
        if "NET/Plugin" in line or "NET/OFI" in line or "net plugin" in line.lower() or "network plugin" in line:
            plugin.append(message)
        match = _PLUGIN_LOADED.search(line)
        if match and (match.group(1) or match.group(2)) not in loaded:
            loaded.append(match.group(1) or match.group(2))
        # NCCL tries IB on every machine; its failure where there is no IB is no plugin's.
        builtin_failed = message.removeprefix("Failed to initialize NET plugin ") in BUILTIN_NETWORKS
        if _PLUGIN_FAILURE.search(line) and not builtin_failed and message not in failures:
            failures.append(message)
        if "NCCL WARN" in line:
            warnings.append(line.split("NCCL WARN", 1)[-1].strip())
    return NcclLogFacts(version, tuple(networks), tuple(plugin), tuple(warnings), tuple(loaded), tuple(failures))


def network_verdict(facts: NcclLogFacts, expect_net: str | None, env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether NCCL used the network it should have, and why; never a silent fallback as success.

    The expected network is ``expect_net``, else NCCL_NET (NCCL refuses any other itself, this
    says so from its log). Without either, NCCL_NET_PLUGIN (unless empty or "none") still asks for
    an external plugin: NCCL falling back to a built-in network (IB, Socket) then fails. Names
    compare case-insensitively, as NCCL compares them; every communicator must have used it.
    """
    why_not = "; ".join([*facts.plugin_failures, *facts.warnings])
    if not facts.networks:
        return False, "NCCL's log names no network ('Using network ...' missing)" + (f": {why_not}" if why_not else "")
    chosen = ", ".join(facts.networks)
    expected, source = expect_net, "--expect-nccl-net"
    if not expected and env.get("NCCL_NET"):
        expected, source = env["NCCL_NET"], "NCCL_NET"
    if expected:
        if any(n.casefold() != expected.casefold() for n in facts.networks):
            return False, f"NCCL used network {chosen}, expected {expected} ({source})" + (f": {why_not}" if why_not else "")
        return True, f"NCCL used network {chosen}, as {source} expects"
    plugin = env.get("NCCL_NET_PLUGIN", "")
    if plugin and plugin.casefold() != "none":
        builtin = [n for n in facts.networks if n.casefold() in (b.casefold() for b in BUILTIN_NETWORKS)]
        if builtin:
            return False, (
                f"NCCL_NET_PLUGIN={plugin} asks for an external plugin, but NCCL used its built-in network "
                f"{', '.join(builtin)}" + (f": {why_not}" if why_not else "")
            )
    return True, f"NCCL used network {chosen}"


def nccl_log_path(env: Mapping[str, str], pid: int, hostname: str) -> str | None:
    """This process's NCCL log file, from the NCCL_DEBUG_FILE pattern, expanded as NCCL does.

    %h is the host name up to its first dot (NCCL's getHostName), %p the pid, %% a percent sign.
    """
    pattern = env.get("NCCL_DEBUG_FILE")
    if not pattern:
        return None
    fields = {"h": hostname.split(".", 1)[0], "p": str(pid), "%": "%"}
    return re.sub(r"%(.)", lambda m: fields.get(m.group(1), m.group(0)), pattern)


def nccl_network_check(nccl_ran: bool, expect_net: str | None) -> CheckResult:
    """The network NCCL picked and the plugin it loaded, read from NCCL's own INFO log."""
    import socket

    name = "env/nccl-network"
    if not nccl_ran:
        return CheckResult.skipped(name, "NCCL did not run (no NCCL backend check ran)")
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return CheckResult.skipped(name, "NCCL_DEBUG is not INFO, so NCCL did not log its network choice")
    path = nccl_log_path(os.environ, os.getpid(), socket.gethostname())
    if path is None or not os.path.exists(path):
        return CheckResult.skipped(name, "NCCL's log went to the terminal (NCCL_DEBUG_FILE unset), not to a file")
    return nccl_network_from_log(path, expect_net, os.environ)


def nccl_network_from_log(path: str, expect_net: str | None, env: Mapping[str, str]) -> CheckResult:
    """The ``env/nccl-network`` verdict from one process's NCCL log file, with ``env`` as that process had it.

    Also what the --nproc launcher reads after a rank died before its own check ran (NCCL crashed
    in its init): NCCL's log is the only witness left of why.
    """
    facts = parse_nccl_log(Path(path).read_text(errors="replace"))
    details = {
        "log_file": path,
        "version_line": facts.version_line,
        "networks": list(facts.networks),
        "plugin_loaded": list(facts.plugin_loaded),
        "plugin_failures": list(facts.plugin_failures),
        "plugin_lines": list(facts.plugin_lines),
        "warnings": list(facts.warnings),
    }
    ok, reason = network_verdict(facts, expect_net, env)
    return CheckResult("env/nccl-network", PASS if ok else FAIL, reason, details)


@dataclass(frozen=True)
class MpiFacts:
    """The MPI library in this process and what it says about CUDA support."""

    library_version: str
    source: str
    cuda_aware: bool | None
    cuda_aware_source: str


def _mpi_library_from_maps() -> str | None:
    paths = loaded_libraries(r"^lib(mpi|mpich|mpi_cray|mpi_gnu_\d+)\.so")
    return paths[0] if paths else None


def _query_cuda_support(lib: ctypes.CDLL) -> tuple[bool | None, str]:
    """Ask the MPI library whether it is CUDA-aware (Open MPI or MPICH extensions), if it can say."""
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support (Open MPI)"
    if hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        # MPIX_GPU_SUPPORT_CUDA is 0 in MPICH's mpi.h.
        if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:
            return bool(supported.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) (MPICH)"
    return None, "the library offers no query"


def mpi_facts(mpi_initialized: bool) -> MpiFacts | None:
    """The MPI library's version and CUDA-awareness, from torch's linked MPI or mpi4py; None if none.

    The CUDA query is only made once MPI is initialised (``mpi_initialized``): the extensions are
    not defined before MPI_Init.
    """
    path = _mpi_library_from_maps()
    source = ""
    if path is None:
        try:
            import mpi4py

            # Read the version without initialising MPI: a later torch MPI backend initialises it.
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
            from mpi4py import MPI
        except ImportError:
            return None
        path = _mpi_library_from_maps()
        source = "mpi4py"
        if path is None:
            return MpiFacts(MPI.Get_library_version().strip(), source, None, "mpi4py found no libmpi to query")
    source = source or "linked into torch"
    lib = ctypes.CDLL(path)
    buffer = ctypes.create_string_buffer(8192)
    length = ctypes.c_int(0)
    lib.MPI_Get_library_version(buffer, ctypes.byref(length))
    version = buffer.value.decode(errors="replace").strip()
    if mpi_initialized:
        cuda_aware, how = _query_cuda_support(lib)
    else:
        cuda_aware, how = None, "not asked: MPI was not initialised"
    return MpiFacts(version, f"{source}: {path}", cuda_aware, how)


def mpi_check(facts: MpiFacts | None) -> CheckResult:
    """The MPI library version (first line of MPI_Get_library_version)."""
    name = "env/mpi"
    if facts is None:
        return CheckResult.skipped(name, "no MPI library: torch has no MPI backend and mpi4py is not installed")
    first = facts.library_version.splitlines()[0] if facts.library_version else "(empty)"
    return CheckResult(name, PASS, first, {"library_version": facts.library_version, "source": facts.source})


def mpi_cuda_aware_check(facts: MpiFacts | None, mpi_cuda_result: CheckResult | None) -> CheckResult:
    """Whether MPI is CUDA-aware: the library's own answer, and the proof of a CUDA collective through torch."""
    import torch
    import torch.distributed as dist

    name = "env/mpi-cuda-aware"
    if facts is None:
        return CheckResult.skipped(name, "no MPI library")
    details: dict[str, Any] = {
        "library_says": facts.cuda_aware,
        "query": facts.cuda_aware_source,
        "MPICH_GPU_SUPPORT_ENABLED": os.environ.get("MPICH_GPU_SUPPORT_ENABLED"),
    }
    if not dist.is_mpi_available():
        return CheckResult.skipped(name, "torch has no MPI backend, so CUDA-aware MPI is unused", **details)
    if not torch.cuda.is_available():
        return CheckResult.skipped(name, "no CUDA device is visible", **details)
    if mpi_cuda_result is None or mpi_cuda_result.status == SKIPPED:
        return CheckResult.skipped(name, "the MPI CUDA correctness check did not run", **details)
    details["cuda_collectives_through_torch"] = mpi_cuda_result.status
    if mpi_cuda_result.status == PASS:
        return CheckResult(name, PASS, "CUDA tensors went through torch's MPI backend with correct results", details)
    return CheckResult(name, FAIL, f"CUDA tensors through torch's MPI backend failed: {mpi_cuda_result.reason}", details)
