"""What a patched NCCL costs a healthy job: the same collectives timed through two (or more) libraries.

Any site can run it to see what the channel's NCCL costs against the same release built stock (same
build flags for both), or what a setting costs with one library (``NCCL_CUMEM_ENABLE=0`` against 1).
Each *variant* is a library and, optionally, environment variables:

    python3 benchmarks/nccl_cost.py --variant stock=/opt/nccl-stock/lib/libnccl.so.2 \\
        --variant patched=/opt/nccl-abortwake/lib/libnccl.so.2 --rounds 3 --json cost.json
    python3 benchmarks/nccl_cost.py --variant cumem-on=$LIB:NCCL_CUMEM_ENABLE=1 \\
        --variant cumem-off=$LIB:NCCL_CUMEM_ENABLE=0

The first variant is the baseline. Every round starts each variant's ranks afresh (one process per
rank, rank r on GPU r modulo the GPUs visible), in an order that alternates from round to round, so
that a drift of the machine (clocks, a neighbour) falls on all variants alike. A rank loads its
library with ctypes (no PyTorch: one process can hold one libnccl only, and PyTorch loads its own)
and the CUDA runtime, and times all_reduce, all_gather and reduce_scatter (float32, sum,
out-of-place) from --min-bytes to --max-bytes, doubling, with CUDA events around --iters calls after
--warmup calls. Bytes are nccl-tests' "size": the all_reduce buffer, all_gather's output and
reduce_scatter's input. Bus bandwidth is nccl-tests' formula: algbw = bytes / time; busbw = algbw
x 2(n-1)/n for all_reduce and x (n-1)/n for all_gather and reduce_scatter.

Per (collective, size): the median over the rounds of each variant's time per call, its busbw, and
against the baseline the ratio (variant / baseline time) and the difference in microseconds. The
JSON holds every sample; the table printed last gives the ratios. Figures go to stdout, progress to
stderr. Exit 0 when the runs completed (a ratio is a figure, not a verdict), 1 when a rank failed, 2
on bad input.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
_NCCL_FLOAT32 = 7  # ncclFloat32 in nccl.h's ncclDataType_t
_NCCL_SUM = 0  # ncclSum
_FLOAT_BYTES = 4
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class UsageError(Exception):
    """Bad input: the message says what to change."""


@dataclass(frozen=True)
class Variant:
    """A library to time, and the environment its ranks get on top of the caller's."""

    label: str
    library: str
    env: Mapping[str, str] = field(default_factory=dict)


def parse_size(text: str) -> int:
    """'1K', '64M', '1G' or a number of bytes."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1] if value and value[-1] in _UNITS else ""
    number = value[: -1] if unit else value
    if not number.isdigit() or int(number) <= 0:
        raise UsageError(f"size {text!r} is not a positive number of bytes (e.g. 1K, 64M, 1G)")
    return int(number) * _UNITS[unit]


def parse_variant(text: str) -> Variant:
    """LABEL=PATH[:KEY=VALUE[,KEY=VALUE...]]."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise UsageError(f"--variant {text!r}: write LABEL=PATH[:KEY=VALUE,...], e.g. stock=/opt/nccl/lib/libnccl.so.2")
    path, _, env_text = rest.partition(":")
    env = {}
    for item in filter(None, env_text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"--variant {text!r}: environment entry {item!r} is not KEY=VALUE")
        env[key] = value
    if not Path(path).is_file():
        raise UsageError(f"--variant {label}: library {path} does not exist (give the path of a libnccl.so.2)")
    return Variant(label, str(Path(path).resolve()), env)


def sizes_between(min_bytes: int, max_bytes: int, nranks: int) -> list[int]:
    """Doubling sizes from min to max, each a whole number of float32 elements per rank."""
    if min_bytes > max_bytes:
        raise UsageError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
    unit = _FLOAT_BYTES * nranks
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(max(unit, size // unit * unit))
        size *= 2
    return sorted(set(sizes))


def bus_bandwidth(collective: str, nbytes: int, seconds: float, nranks: int) -> float:
    """nccl-tests' bus bandwidth in GB/s (1e9 bytes) for one call of ``nbytes`` taking ``seconds``."""
    algbw = nbytes / seconds / 1e9
    factor = {"all_reduce": 2 * (nranks - 1) / nranks}.get(collective, (nranks - 1) / nranks)
    return algbw * factor


def round_orders(labels: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the variants in each round: as given, then reversed, alternately."""
    return [list(labels) if r % 2 == 0 else list(reversed(labels)) for r in range(rounds)]


def summarize(samples: Mapping[str, Mapping[str, Mapping[int, Sequence[float]]]], baseline: str, nranks: int) -> list[dict[str, Any]]:
    """One row per (collective, size, variant): median time per call over the rounds, busbw, and the
    ratio and microseconds against the baseline's median. ``samples[variant][collective][bytes]`` are
    seconds per call, one per round."""
    rows = []
    base = samples[baseline]
    for collective in COLLECTIVES:
        for nbytes in sorted(base.get(collective, {})):
            base_s = statistics.median(base[collective][nbytes])
            for label, per_coll in samples.items():
                values = per_coll.get(collective, {}).get(nbytes)
                if not values:
                    continue
                median_s = statistics.median(values)
                rows.append({
                    "collective": collective,
                    "bytes": nbytes,
                    "variant": label,
                    "median_us": round(median_s * 1e6, 3),
                    "min_us": round(min(values) * 1e6, 3),
                    "max_us": round(max(values) * 1e6, 3),
                    "busbw_gbps": round(bus_bandwidth(collective, nbytes, median_s, nranks), 3),
                    "ratio": round(median_s / base_s, 4),
                    "delta_us": round((median_s - base_s) * 1e6, 3),
                    "rounds": len(values),
                })  # fmt: skip
    return rows


def human_size(nbytes: int) -> str:
    """1024 -> '1K', 8 MiB -> '8M'."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def ratio_table(rows: Sequence[Mapping[str, Any]], baseline: str) -> str:
    """The report's last lines: per size, each collective's variant/baseline time ratio (and, below
    1 MiB, the difference in microseconds)."""
    others = sorted({r["variant"] for r in rows if r["variant"] != baseline})
    by_key = {(r["collective"], r["bytes"], r["variant"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    lines = []
    for label in others:
        lines.append(f"{label} / {baseline}: time ratio per call (median over rounds; below 1M also +us)")
        lines.append("size    " + "".join(f"{c:>24}" for c in COLLECTIVES))
        for nbytes in sizes:
            cells = []
            for collective in COLLECTIVES:
                row = by_key.get((collective, nbytes, label))
                if row is None:
                    cells.append(f"{'-':>24}")
                    continue
                text = f"{row['ratio']:.3f}"
                if nbytes < _UNITS["M"]:
                    text += f" ({row['delta_us']:+.2f} us)"
                cells.append(f"{text:>24}")
            lines.append(f"{human_size(nbytes):<8}" + "".join(cells))
    return "\n".join(lines)


def busbw_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Each variant's median time and busbw per collective and size."""
    lines = [f"{'collective':<15}{'size':>7}{'variant':>14}{'us/call':>12}{'busbw GB/s':>12}"]
    for r in rows:
        lines.append(f"{r['collective']:<15}{human_size(r['bytes']):>7}{r['variant']:>14}{r['median_us']:>12.2f}{r['busbw_gbps']:>12.2f}")
    return "\n".join(lines)


# --- one rank ----------------------------------------------------------------------------------------


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _load_cudart() -> ctypes.CDLL:
    candidates = [os.environ.get("NCCL_COST_CUDART", "")]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates += [f"{cuda_home}/lib64/libcudart.so", ctypes.util.find_library("cudart") or ""]
    for path in filter(None, candidates):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError(f"no CUDA runtime (libcudart.so) under {cuda_home}/lib64 or on the loader's path; set NCCL_COST_CUDART")


def _check(what: str, code: int) -> None:
    if code != 0:
        raise RuntimeError(f"{what} returned {code}")


def run_rank(rank: int, nranks: int, library: str, id_file: Path, sizes: Sequence[int], warmup: int, iters: int) -> dict[str, Any]:
    """Time the collectives in this process; return seconds per call per collective and size."""
    cuda = _load_cudart()
    nccl = ctypes.CDLL(library)
    count = ctypes.c_int(0)
    _check("cudaGetDeviceCount", cuda.cudaGetDeviceCount(ctypes.byref(count)))
    device = rank % max(1, count.value)
    _check("cudaSetDevice", cuda.cudaSetDevice(device))
    if rank == 0:
        uid = _UniqueId()
        _check("ncclGetUniqueId", nccl.ncclGetUniqueId(ctypes.byref(uid)))
        tmp = id_file.with_suffix(".tmp")
        # The whole struct: reading the c_char array field would stop at its first NUL byte.
        tmp.write_bytes(bytes(memoryview(uid)))
        tmp.rename(id_file)
    else:
        deadline = time.monotonic() + 60
        while not id_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 published no NCCL unique id within 60 s")
            time.sleep(0.01)
        uid = _UniqueId.from_buffer_copy(id_file.read_bytes())
    comm = ctypes.c_void_p()
    _check("ncclCommInitRank", nccl.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank))
    version = ctypes.c_int(0)
    nccl.ncclGetVersion(ctypes.byref(version))
    stream = ctypes.c_void_p()
    _check("cudaStreamCreateWithFlags", cuda.cudaStreamCreateWithFlags(ctypes.byref(stream), 1))
    largest = max(sizes)
    send, recv = ctypes.c_void_p(), ctypes.c_void_p()
    _check("cudaMalloc", cuda.cudaMalloc(ctypes.byref(send), ctypes.c_size_t(largest)))
    _check("cudaMalloc", cuda.cudaMalloc(ctypes.byref(recv), ctypes.c_size_t(largest)))
    # Not zeros: 0x3f bytes are floats near 0.75.
    _check("cudaMemset", cuda.cudaMemset(send, 0x3F, ctypes.c_size_t(largest)))
    start, stop = ctypes.c_void_p(), ctypes.c_void_p()
    _check("cudaEventCreate", cuda.cudaEventCreate(ctypes.byref(start)))
    _check("cudaEventCreate", cuda.cudaEventCreate(ctypes.byref(stop)))
    size_t = ctypes.c_size_t

    def call(collective: str, nbytes: int) -> int:
        elements = nbytes // _FLOAT_BYTES
        if collective == "all_reduce":
            return nccl.ncclAllReduce(send, recv, size_t(elements), _NCCL_FLOAT32, _NCCL_SUM, comm, stream)
        if collective == "all_gather":
            return nccl.ncclAllGather(send, recv, size_t(elements // nranks), _NCCL_FLOAT32, comm, stream)
        return nccl.ncclReduceScatter(send, recv, size_t(elements // nranks), _NCCL_FLOAT32, _NCCL_SUM, comm, stream)

    seconds: dict[str, dict[int, float]] = {}
    for collective in COLLECTIVES:
        seconds[collective] = {}
        for nbytes in sizes:
            # Fewer calls for the large sizes: a 1 GiB all_reduce takes milliseconds.
            n = max(5, min(iters, int(iters * (8 << 20) / nbytes))) if nbytes > (8 << 20) else iters
            for _ in range(warmup):
                _check(collective, call(collective, nbytes))
            _check("cudaEventRecord", cuda.cudaEventRecord(start, stream))
            for _ in range(n):
                _check(collective, call(collective, nbytes))
            _check("cudaEventRecord", cuda.cudaEventRecord(stop, stream))
            _check("cudaEventSynchronize", cuda.cudaEventSynchronize(stop))
            ms = ctypes.c_float(0)
            _check("cudaEventElapsedTime", cuda.cudaEventElapsedTime(ctypes.byref(ms), start, stop))
            seconds[collective][nbytes] = ms.value / 1e3 / n
    nccl.ncclCommDestroy(comm)
    return {"rank": rank, "device": device, "nccl_version": version.value, "library": library, "seconds": seconds}


# --- the launcher --------------------------------------------------------------------------------------


def run_variant(variant: Variant, nranks: int, sizes: Sequence[int], warmup: int, iters: int, timeout_s: float) -> dict[str, Any]:
    """Start the variant's ranks, wait for them; rank 0's timings (the ranks time the same calls)."""
    with tempfile.TemporaryDirectory(prefix="nccl-cost-") as tmp:
        id_file = Path(tmp) / "uid"
        env = {**os.environ, **variant.env}
        procs = []
        for rank in range(nranks):
            argv = [sys.executable, __file__, "--worker", str(rank), "--nranks", str(nranks), "--id-file", str(id_file),
                    "--library", variant.library, "--sizes", ",".join(map(str, sizes)), "--warmup", str(warmup), "--iters", str(iters)]  # fmt: skip
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = []
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{variant.label}: a rank did not finish within {timeout_s:.0f} s") from None
            if proc.returncode != 0:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{variant.label}: a rank exited {proc.returncode}: {err.strip()[-400:]}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    result = outputs[0]
    result["seconds"] = {c: {int(k): v for k, v in per.items()} for c, per in result["seconds"].items()}
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 benchmarks/nccl_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=PATH[:K=V,...]",
                   help="a library (and environment) to time; at least two, the first is the baseline")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each starts every variant afresh, alternating the order (default 3)")
    p.add_argument("--nranks", type=int, default=2, help="ranks, one process each, rank r on GPU r mod the GPUs (default 2)")
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="1G")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=40, help="timed calls per size (fewer above 8 MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one variant's ranks may take")
    p.add_argument("--json", type=Path, help="write every sample and the summary here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--id-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--library", help=argparse.SUPPRESS)
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        sizes = [int(s) for s in args.sizes.split(",")]
        result = run_rank(args.worker, args.nranks, args.library, args.id_file, sizes, args.warmup, args.iters)
        print(json.dumps(result))
        return 0
    try:
        variants = [parse_variant(v) for v in args.variant]
        if len(variants) < 2:
            raise UsageError("give at least two --variant (the first is the baseline)")
        labels = [v.label for v in variants]
        if len(set(labels)) != len(labels):
            raise UsageError(f"variant labels must differ: {', '.join(labels)}")
        if args.rounds < 1 or args.nranks < 2 or args.iters < 1 or args.warmup < 0:
            raise UsageError("--rounds and --iters must be >= 1, --nranks >= 2, --warmup >= 0")
        sizes = sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes), args.nranks)
        if args.json is not None and not args.json.parent.is_dir():
            raise UsageError(f"--json {args.json}: folder {args.json.parent} does not exist")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    by_label = {v.label: v for v in variants}
    samples: dict[str, dict[str, dict[int, list[float]]]] = {v.label: {c: {} for c in COLLECTIVES} for v in variants}
    libraries: dict[str, Any] = {}
    for index, order in enumerate(round_orders(labels, args.rounds)):
        for label in order:
            print(f"round {index + 1}/{args.rounds}: {label} ...", file=sys.stderr, flush=True)
            try:
                result = run_variant(by_label[label], args.nranks, sizes, args.warmup, args.iters, args.timeout)
            except RuntimeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            libraries[label] = {"library": result["library"], "nccl_version": result["nccl_version"], "env": dict(by_label[label].env)}
            for collective, per in result["seconds"].items():
                for nbytes, value in per.items():
                    samples[label][collective].setdefault(nbytes, []).append(value)
    rows = summarize(samples, labels[0], args.nranks)
    if args.json is not None:
        report = {"baseline": labels[0], "nranks": args.nranks, "rounds": args.rounds, "variants": libraries,
                  "samples": {l: {c: {str(b): v for b, v in per.items()} for c, per in s.items()} for l, s in samples.items()},
                  "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))
    print(busbw_table(rows))
    print()
    print(ratio_table(rows, labels[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
