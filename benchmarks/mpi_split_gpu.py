"""Where the time of one cudampi all_reduce goes (issue 57): run under ``mpiexec -n 2``.

For each composition mode named (``CUDAMPI_COMPOSED``: cuda, all, none, auto) it creates two groups of
every rank, one with ``CUDAMPI_PROFILE=0`` (the timing a user sees) and one with ``CUDAMPI_PROFILE=1``
(the backend's own phases: each MPI call, each kernel, each synchronize, the worker's queue), and with
``--nccl`` an NCCL group on the same GPUs for reference. Per size: ``--warmup`` untimed calls, then
``--iters`` timed ones; a call's time is the slower rank's, from a synchronized device to a
synchronized device after ``all_reduce`` returned. Every result is compared with the exact sum.

    mpiexec -n 2 python3 benchmarks/mpi_split_gpu.py --device cuda --modes cuda,none,auto --nccl \\
        --sizes 1M,16M,64M,256M --json backend.json

Rank 0 writes one JSON document (``rows``: one per backend, mode, profile setting and size, with the
median/p10/p90 time and, for profiled rows, the median time of each phase) and a table on stderr.
Exit 0 when every result was exact, 1 when one was not, 2 on bad arguments (nothing written).
A mode whose call takes longer than ``--max-call-s`` is not run at larger sizes (a ``skipped`` row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

MODES = ("cuda", "all", "none", "auto")


def parse_bytes(text: str) -> int:
    """``1M``, ``64K``, ``1G`` or a plain count of bytes (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"{text!r} is not a byte size (e.g. 1M, 64K, 4096)")
    return int(digits) * scale


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default="1M,16M,64M,256M", help="comma-separated byte sizes")
    parser.add_argument("--modes", default="cuda,none,auto", help=f"CUDAMPI_COMPOSED values, of {','.join(MODES)}")
    parser.add_argument("--no-profile", action="store_true", help="only the groups with the profile off")
    parser.add_argument("--nccl", action="store_true", help="an NCCL group on the same GPUs for reference")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-call-s", type=float, default=1.0, help="larger sizes of a mode are skipped past this")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, required=True, help="where rank 0 writes the document")
    args = parser.parse_args(argv)
    try:
        args.sizes = [parse_bytes(item) for item in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(f"--sizes: {exc}")
    args.modes = args.modes.split(",")
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes: {', '.join(unknown)} not among {', '.join(MODES)}")
    if args.iters < 1 or args.warmup < 0 or args.max_call_s <= 0:
        parser.error("--iters needs >= 1, --warmup >= 0, --max-call-s > 0")
    if args.nccl and args.device != "cuda":
        parser.error("--nccl needs --device cuda")
    if not args.json.parent.is_dir():
        parser.error(f"--json: folder {args.json.parent} does not exist")
    return args


def median_phases(records: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per phase name, the median over calls of its summed wall (and device) time in each call."""
    per_call: list[dict[str, list[float | None]]] = []
    for record in records:
        sums: dict[str, list[float | None]] = {}
        for phase in record["phases"]:
            wall, device = sums.get(phase["name"], [0.0, None])
            if phase["device_s"] is not None:
                device = (device or 0.0) + phase["device_s"]
            sums[phase["name"]] = [wall + phase["wall_s"], device]
        per_call.append(sums)
    names = list(dict.fromkeys(name for sums in per_call for name in sums))
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        walls = [sums[name][0] for sums in per_call if name in sums]
        devices = [sums[name][1] for sums in per_call if name in sums and sums[name][1] is not None]
        out[name] = {"wall_s": statistics.median(walls), "device_s": statistics.median(devices) if devices else None}
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    import torch_mpi_backend

    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("cudampi", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    # The slower rank's times travel over a group of MPI_Allreduce on CPU tensors.
    os.environ["CUDAMPI_COMPOSED"], os.environ["CUDAMPI_PROFILE"] = "none", "0"
    control = dist.new_group(list(range(world)))
    groups: list[tuple[str, str, bool, object]] = []
    for mode in args.modes:
        for profile in (False,) if args.no_profile else (False, True):
            os.environ["CUDAMPI_COMPOSED"], os.environ["CUDAMPI_PROFILE"] = mode, "1" if profile else "0"
            groups.append(("cudampi", mode, profile, dist.new_group(list(range(world)))))
    if args.nccl:
        groups.append(("nccl", "-", False, dist.new_group(list(range(world)), backend="nccl")))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows: list[dict] = []
    all_exact = True
    expected = float(world * (world + 1) // 2)
    for backend, mode, profile, group in groups:
        for size in args.sizes:
            row: dict = {"backend": backend, "mode": mode, "profile": profile, "bytes": size}
            if rows and any(r.get("too_slow") for r in rows if (r["backend"], r["mode"], r["profile"]) == (backend, mode, profile)):
                rows.append(dict(row, skipped=f"a smaller size took longer than {args.max_call_s} s a call"))
                continue
            tensor = torch.empty(size // 4, dtype=torch.float32, device=device)
            times: list[float] = []
            stopped = False
            for call in range(args.warmup + args.iters):
                tensor.fill_(float(rank + 1))
                sync()
                start = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                sync()
                mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=control)
                slowest = float(mine.item())
                if call >= args.warmup:
                    times.append(slowest)
                if slowest > args.max_call_s:
                    stopped = True
                    break
            exact = bool(torch.all(tensor == expected).item())
            flag = torch.tensor([0 if exact else 1], dtype=torch.int64)
            dist.all_reduce(flag, group=control)
            exact = int(flag.item()) == 0
            all_exact = all_exact and exact
            row.update(exact=exact, calls=len(times), too_slow=stopped)
            if times:
                ordered = sorted(times)
                row.update(median_s=statistics.median(ordered), p10_s=ordered[len(ordered) // 10],
                           p90_s=ordered[(len(ordered) * 9) // 10])  # fmt: skip
            if profile:
                records = torch_mpi_backend.profile_records()[args.warmup :]
                torch_mpi_backend.profile_reset()
                if records:
                    row.update(path=records[-1]["path"], total_s=statistics.median(r["total_s"] for r in records),
                               phases=median_phases(records))  # fmt: skip
            rows.append(row)
            del tensor
            if rank == 0:
                median = row.get("median_s")
                shown = f"{median * 1e3:9.3f} ms" if median is not None else "   no timed call"
                print(f"[mpi_split] {backend:7} {mode:5} profile={int(profile)} {size:>11} B {shown}"
                      f" {'exact' if exact else 'WRONG'}{' (too slow: larger sizes skipped)' if stopped else ''}",
                      file=sys.stderr, flush=True)  # fmt: skip
                if profile and "phases" in row:
                    parts = ", ".join(f"{name} {p['wall_s'] * 1e6:.0f} us" for name, p in row["phases"].items())
                    print(f"[mpi_split]   phases ({row['path']}): {parts}", file=sys.stderr, flush=True)
    if rank == 0:
        document = {
            "label": args.label,
            "device": args.device,
            "ranks": world,
            "torch": torch.__version__,
            "mpi": torch_mpi_backend.mpi_library_version().splitlines()[0],
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MPIR_CVAR_", "FI_", "NCCL_", "YAKSA_"))},
            "warmup": args.warmup,
            "iters": args.iters,
            "rows": rows,
        }
        partial = args.json.with_name(args.json.name + ".partial")
        partial.write_text(json.dumps(document, indent=1))
        partial.replace(args.json)
    # Every group's queue drained before the groups go (docs/howto/mpi-without-a-rebuild.md, "At exit"): on PyTorch
    # releases without Backend::shutdown (2.6.0) destroy_process_group puts them out of the exit drain's reach.
    torch_mpi_backend.drain()
    dist.destroy_process_group()
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
