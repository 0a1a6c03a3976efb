"""Tables of the GPU runs, from the suite's JSON documents: ``python -m torch_dist_check.tables``.

Two tables, each with the goals it is read against (docs/howto/mpi-without-a-rebuild.md, docs/reference/nccl.md):

``mpi``: a CUDA-aware MPI's collectives on CUDA tensors against the same MPI on CPU tensors (host
staging) and NCCL's bus bandwidth of the same job (the ceiling). Rows: collective x size; goals:
CUDA >= host staging at every size from ``--floor`` (1 MiB), all_reduce >= ``--nccl-share`` (0.5) of
NCCL's busbw from ``--from`` (64 MiB), every correctness case exact. The CPU document is optional
(four ranks ran CUDA only); NCCL's rows may sit in either document.

``net``: NCCL's all_reduce through network plugins, one document a run (``--run LABEL=FILE``),
against the runs labelled ``--baseline`` (NCCL's Socket). Runs that share a label (rounds, a baseline
before and after) make one row: each size's median busbw, with the lowest and highest where there are
several. Rows: label x size; goals: the median busbw >= ``--ratio`` (0.95) x the baseline's median at
every size from ``--from`` (64 MiB), every case exact, the network NCCL used the one each run expected
(env/nccl-network).

The table is Markdown on stdout (``--json`` prints the figures and verdicts instead), sizes from
``--min-bytes`` (1 MiB) on; the goals' verdicts follow the table. Exit 0 whether or not a goal was met (the verdicts say it), 2 on bad input
(a file missing or not the suite's JSON, a check missing), with a hint and nothing printed on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch_dist_check.checks.bandwidth import COLLECTIVES, parse_size
from torch_dist_check.report.results import EXIT_OK, EXIT_USAGE, PASS


class InputError(Exception):
    """A document cannot give the table what it needs; ``hint`` says what to pass instead."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class Goal:
    """One goal and whether the figures meet it; ``misses`` names each row that does not."""

    goal: str
    met: bool
    misses: list[str]


def load(path: str) -> dict[str, Any]:
    """The suite's JSON document at ``path``, checked for its shape."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file", "pass the --json file a torch_dist_check run wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a JSON document ({exc})", "pass the --json file a torch_dist_check run wrote") from None
    if not isinstance(document, dict) or document.get("tool") != "torch_dist_check" or not isinstance(document.get("checks"), list):
        raise InputError(f"{path}: not a torch_dist_check document (no tool/checks)", "pass the --json file a torch_dist_check run wrote")
    return document


def _checks(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in document["checks"]}


def find_check(documents: Sequence[tuple[str, dict[str, Any]]], name: str, required: bool = True) -> dict[str, Any] | None:
    """The check ``name`` from the first document that has it."""
    for _, document in documents:
        check = _checks(document).get(name)
        if check is not None:
            return check
    if required:
        where = ", ".join(path for path, _ in documents)
        raise InputError(f"no check {name} in {where}", f"run the suite with the backend and --checks that give {name}")
    return None


def sweep(documents: Sequence[tuple[str, dict[str, Any]]], name: str, required: bool = True) -> dict[tuple[str, int], dict[str, Any]]:
    """The rows of bandwidth check ``name`` keyed by (collective, bytes); empty if absent and not required."""
    check = find_check(documents, name, required)
    if check is None:
        return {}
    rows = check.get("details", {}).get("rows")
    if not rows:
        raise InputError(f"{name} has no rows (status {check.get('status')}: {check.get('reason')})",
                         "a bandwidth check that ran has rows; look at the run's log for why this one did not")  # fmt: skip
    return {(row["collective"], int(row["bytes"])): row for row in rows}


def world_size(documents: Sequence[tuple[str, dict[str, Any]]]) -> int | None:
    for _, document in documents:
        size = document.get("job", {}).get("world_size")
        if size:
            return int(size)
    return None


def human_size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    ms = row["time_us"] / 1000.0
    return f"{row['busbw_GBps']:.2f} ({ms:.3g} ms)"


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if a is None or b is None or b["busbw_GBps"] <= 0:
        return None
    return a["busbw_GBps"] / b["busbw_GBps"]


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def correctness_goal(documents: Sequence[tuple[str, dict[str, Any]]], names: Sequence[str]) -> Goal:
    """Every named correctness check passed (exact) on every rank."""
    misses = []
    for name in names:
        check = find_check(documents, name)
        assert check is not None
        details = check.get("details", {})
        if check["status"] != PASS or details.get("failures"):
            misses.append(f"{name}: {check['status']}: {check.get('reason', '')}")
    cases = []
    for name in names:
        check = find_check(documents, name)
        assert check is not None
        cases.append(f"{name} {check.get('details', {}).get('cases', '?')} cases")
    return Goal("every case exact (" + "; ".join(cases) + ")", not misses, misses)


def mpi_table(cuda_doc: tuple[str, dict[str, Any]], cpu_doc: tuple[str, dict[str, Any]] | None, backend: str,
              floor: int, start: int, share: float, min_bytes: int = 0) -> dict[str, Any]:  # fmt: skip
    """Figures and goals of the ``mpi`` table."""
    documents = [cuda_doc] + ([cpu_doc] if cpu_doc else [])
    cuda = sweep([cuda_doc], f"bandwidth/{backend}/cuda")
    host = sweep([cpu_doc], f"bandwidth/{backend}/cpu") if cpu_doc else {}
    nccl = sweep(documents, "bandwidth/nccl/cuda", required=False)
    rows = []
    for collective in COLLECTIVES:
        sizes = sorted(size for size in {s for (c, s) in cuda if c == collective} | {s for (c, s) in host if c == collective}
                       if size >= min_bytes)  # fmt: skip
        for size in sizes:
            key = (collective, size)
            rows.append({
                "collective": collective, "bytes": size,
                "cuda": cuda.get(key), "host": host.get(key), "nccl": nccl.get(key),
                "cuda_over_host": _ratio(cuda.get(key), host.get(key)),
                "cuda_over_nccl": _ratio(cuda.get(key), nccl.get(key)),
            })  # fmt: skip
    goals = []
    if cpu_doc:
        misses = [f"{r['collective']} {human_size(r['bytes'])}: {_fmt_ratio(r['cuda_over_host'])}"
                  for r in rows if r["bytes"] >= floor and r["cuda_over_host"] is not None and r["cuda_over_host"] < 1.0]  # fmt: skip
        unmatched = [f"{r['collective']} {human_size(r['bytes'])}: no CUDA row" for r in rows
                     if r["bytes"] >= floor and r["host"] is not None and r["cuda"] is None]  # fmt: skip
        goals.append(Goal(f"CUDA >= host staging at every size from {human_size(floor)}", not misses + unmatched, misses + unmatched))
    if nccl:
        reduce_rows = [r for r in rows if r["collective"] == "all_reduce" and r["bytes"] >= start]
        misses = [f"all_reduce {human_size(r['bytes'])}: {_fmt_ratio(r['cuda_over_nccl'])}" for r in reduce_rows
                  if r["cuda_over_nccl"] is None or r["cuda_over_nccl"] < share]  # fmt: skip
        goals.append(Goal(f"all_reduce >= {share:.0%} of NCCL's busbw from {human_size(start)}", bool(reduce_rows) and not misses,
                          misses or ([] if reduce_rows else [f"no all_reduce row from {human_size(start)}"])))  # fmt: skip
    names = [f"correctness/{backend}/cuda"] + ([f"correctness/{backend}/cpu"] if cpu_doc else [])
    if find_check(documents, "correctness/nccl/cuda", required=False) is not None:
        names.append("correctness/nccl/cuda")
    goals.append(correctness_goal(documents, names))
    return {"table": "mpi", "backend": backend, "world_size": world_size(documents), "rows": rows,
            "goals": [asdict(g) for g in goals]}  # fmt: skip


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def net_table(runs: Sequence[tuple[str, str, dict[str, Any]]], baseline: str, start: int, ratio: float,
              min_bytes: int = 0) -> dict[str, Any]:  # fmt: skip
    """Figures and goals of the ``net`` table; ``runs`` are (label, path, document), a label's runs one row."""
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for label, path, doc in runs:
        groups.setdefault(label, []).append((path, doc))
    if baseline not in groups:
        raise InputError(f"--baseline {baseline} is none of the runs ({', '.join(groups)})", "name one of the --run labels")
    sweeps = {label: [sweep([run], "bandwidth/nccl/cuda") for run in group] for label, group in groups.items()}
    sizes = sorted({size for rows in sweeps.values() for one in rows for (c, size) in one if c == "all_reduce" and size >= min_bytes})

    # Each label's busbw figures at each size, one per run that has the size.
    figures = {label: {size: [one[("all_reduce", size)]["busbw_GBps"] for one in rows if ("all_reduce", size) in one]
                       for size in sizes} for label, rows in sweeps.items()}  # fmt: skip
    medians = {label: {size: _median(v) if v else None for size, v in by_size.items()} for label, by_size in figures.items()}
    base = medians[baseline]
    table = []
    goals_misses = []
    correctness_misses = []
    network_misses = []
    for label, group in groups.items():
        busbw = medians[label]
        ratios = {size: busbw[size] / base[size] if busbw[size] is not None and base[size] else None for size in sizes}
        from_start = [ratios[s] for s in sizes if s >= start and ratios[s] is not None]
        lowest = min(from_start) if from_start else None
        statuses, cases, networks = set(), [], []
        for path, doc in group:
            network = find_check([(path, doc)], "env/nccl-network", required=False)
            correct = find_check([(path, doc)], "correctness/nccl/cuda")
            assert correct is not None
            statuses.add(correct["status"])
            cases.append(str(correct.get("details", {}).get("cases", "?")))
            if correct["status"] != PASS or correct.get("details", {}).get("failures"):
                correctness_misses.append(f"{label} ({path}): {correct['status']}: {correct.get('reason', '')}")
            if network is None or network["status"] != PASS:
                network_misses.append(f"{label}: {network['status'] + ': ' + network['reason'] if network else 'no env/nccl-network check'}")
            networks.append(network)
        per_run = cases[0] if len(set(cases)) == 1 else "/".join(cases)
        table.append({
            "label": label, "runs": len(group), "files": [path for path, _ in group], "busbw": busbw,
            "busbw_range": {size: ([min(v), max(v)] if v else None) for size, v in figures[label].items()},
            "ratios": ratios, "lowest_ratio_from_start": lowest,
            "network": networks[0]["reason"] if networks[0] else None, "network_status": networks[0]["status"] if networks[0] else None,
            "correctness": f"{'/'.join(sorted(statuses))}: {per_run} cases" + (f" x {len(group)} runs" if len(group) > 1 else ""),
        })  # fmt: skip
        if label != baseline and (lowest is None or lowest < ratio):
            goals_misses.append(f"{label}: lowest {_fmt_ratio(lowest)}")
    goals = [
        Goal(f"busbw >= {ratio}x {baseline} at every size from {human_size(start)}", not goals_misses, goals_misses),
        Goal("every case exact", not correctness_misses, correctness_misses),
        Goal("NCCL used the network each run expected (env/nccl-network)", not network_misses, network_misses),
    ]
    return {"table": "net", "baseline": baseline, "sizes": sizes, "rows": table, "goals": [asdict(g) for g in goals]}


def _goal_lines(goals: Sequence[dict[str, Any]]) -> list[str]:
    lines = [""]
    for goal in goals:
        verdict = "met" if goal["met"] else "MISSED: " + "; ".join(goal["misses"])
        lines.append(f"- {goal['goal']}: {verdict}")
    return lines


def render_mpi(result: dict[str, Any]) -> str:
    backend = result["backend"]
    head = (f"| collective | size | {backend}, CUDA tensors | host staging (CPU tensors) | NCCL | CUDA / host | CUDA / NCCL |\n"
            "| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    lines = [f"Bus bandwidth, GB/s (time a call), {result['world_size']} ranks:", "", head]
    for row in result["rows"]:
        lines.append(f"| {row['collective']} | {human_size(row['bytes'])} | {_cell(row['cuda'])} | {_cell(row['host'])} | "
                     f"{_cell(row['nccl'])} | {_fmt_ratio(row['cuda_over_host'])} | {_fmt_ratio(row['cuda_over_nccl'])} |")  # fmt: skip
    return "\n".join(lines + _goal_lines(result["goals"])) + "\n"


def render_net(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    several = any(row["runs"] > 1 for row in result["rows"])
    head = "| run | " + " | ".join(human_size(s) for s in sizes) + " | lowest ratio to " + result["baseline"] + " | correctness |"
    title = "all_reduce bus bandwidth, GB/s" + (" (median of a label's runs, lowest-highest):" if several else ":")
    lines = [title, "", head, "| --- " * (len(sizes) + 3) + "|"]
    for row in result["rows"]:
        cells = []
        for s in sizes:
            value, spread = row["busbw"][s], row["busbw_range"][s]
            if value is None:
                cells.append("-")
            else:
                cells.append(f"{value:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if row["runs"] > 1 else ""))
        label = row["label"] + (f" ({row['runs']} runs)" if row["runs"] > 1 else "")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_fmt_ratio(row['lowest_ratio_from_start'])} | {row['correctness']} |")
    return "\n".join(lines + _goal_lines(result["goals"])) + "\n"


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1M, 64M, 1G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return value


def _run_arg(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"--run takes LABEL=FILE, not {text!r} (e.g. socket=bw-socket.json)")
    return label, path


# The peer-loss figures a row shows (seconds unless named), in this order, where the runs have them.
PEERLOSS_FIGURES = ("exception_s", "first_step_s", "join_s", "transfer_s", "agree_after_steps")


def peerloss_table(runs: Sequence[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """One row per label: the peer-loss checks' runs in its documents pooled, each figure's median and worst,
    how many passed, and the HSDP join's split (each stage's median) where the runs have one."""
    pooled: dict[str, list[dict[str, Any]]] = {}
    for label, path, document in runs:
        checks = [c for name, c in _checks(document).items() if name.startswith("peerloss/")]
        if not checks:
            raise InputError(f"{path} has no peerloss check", "give the JSON of a `--checks peerloss` run")
        pooled.setdefault(label, []).extend(r for c in checks for r in (c.get("details") or {}).get("runs", []))
    rows = []
    for label, found in pooled.items():
        row: dict[str, Any] = {"label": label, "runs": len(found), "passed": sum(1 for r in found if r.get("ok"))}
        for figure in PEERLOSS_FIGURES:
            values = [r[figure] for r in found if isinstance(r.get(figure), (int, float))]
            if values:
                row[figure] = {"median": round(_median(values), 4), "worst": max(values), "n": len(values)}
        splits = [r["join_split"] for r in found if isinstance(r.get("join_split"), dict)]
        if splits:
            row["join_split"] = {stage: round(_median([s[stage] for s in splits if stage in s]), 4) for stage in splits[0]}
        rows.append(row)
    return {"table": "peerloss", "rows": rows}


def render_peerloss(result: dict[str, Any]) -> str:
    rows = result["rows"]
    figures = [f for f in PEERLOSS_FIGURES if any(f in r for r in rows)]
    stages = list(dict.fromkeys(stage for r in rows for stage in r.get("join_split", {})))
    head = ["row", "runs", "passed", *(f"{f} median / worst" for f in figures), *(f"{s} (median)" for s in stages)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        cells = [r["label"], str(r["runs"]), str(r["passed"])]
        cells += [f"{r[f]['median']:g} / {r[f]['worst']:g}" if f in r else "-" for f in figures]
        cells += [f"{r['join_split'][s]:g}" if s in r.get("join_split", {}) else "-" for s in stages]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _runs_option(sub: argparse.ArgumentParser, help_text: str) -> None:
    sub.add_argument("--run", dest="runs", action="append", type=_run_arg, required=True, metavar="LABEL=FILE", help=help_text)


EXIT_STATUS = """\
exit status:
  0    the table was printed (a goal missed or not: the verdicts say it)
  2    bad input: a file missing or not the suite's JSON, a check missing;
       a hint on stderr, nothing on stdout"""
EXAMPLES = {
    "mpi": "python -m torch_dist_check.tables mpi --cuda cuda.json --cpu cpu.json",
    "net": "python -m torch_dist_check.tables net --run socket=bw-socket.json --run ofi=bw-ofi.json --baseline socket",
    "peerloss": "python -m torch_dist_check.tables peerloss --run watcher=peerloss-1.json --run watcher=peerloss-2.json",
}


def _epilog(*tables: str) -> str:
    return "examples:\n" + "\n".join(f"  {EXAMPLES[t]}" for t in tables) + "\n\n" + EXIT_STATUS


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m torch_dist_check.tables", description="Tables of the GPU runs from the suite's JSON documents, each with the goals it is\n"
                                  "read against and their verdicts (docs/howto/mpi-without-a-rebuild.md, docs/reference/nccl.md).",
                                  epilog=_epilog("mpi", "net"), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = top.add_subparsers(dest="table", required=True, metavar="TABLE")

    def table(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary, epilog=_epilog(name),
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip

    mpi = table("mpi", "an MPI backend on CUDA tensors against host staging and NCCL")
    mpi.add_argument("--cuda", required=True, help="the suite's JSON of the run on CUDA tensors (NCCL's rows may be in it; required)")
    mpi.add_argument("--cpu", help="the suite's JSON of the run on CPU tensors (host staging; default: none, CUDA rows alone)")
    mpi.add_argument("--backend", default="cudampi", help="the MPI backend's name in the checks (default cudampi)")
    mpi.add_argument("--floor", type=_size, default=_size("1M"), help="CUDA >= host staging from this size (default 1M)")
    mpi.add_argument("--from", dest="start", type=_size, default=_size("64M"), help="the NCCL goal from this size (default 64M)")
    mpi.add_argument("--nccl-share", type=float, default=0.5, help="all_reduce's least share of NCCL's busbw (default 0.5)")
    mpi.add_argument("--min-bytes", type=_size, default=_size("1M"), help="rows from this size (default 1M)")
    mpi.add_argument("--json", action="store_true", help="print the figures and verdicts as JSON on stdout")
    net = table("net", "NCCL through network plugins against a baseline network")
    _runs_option(net, "LABEL=FILE, once per run; runs that share a label make one row (median, lowest-highest; required)")
    net.add_argument("--baseline", required=True, help="the label of the runs the others are compared with (required)")
    net.add_argument("--from", dest="start", type=_size, default=_size("64M"), help="the ratio goal from this size (default 64M)")
    net.add_argument("--ratio", type=float, default=0.95, help="least busbw ratio to the baseline (default 0.95)")
    net.add_argument("--min-bytes", type=_size, default=_size("1M"), help="columns from this size (default 1M)")
    net.add_argument("--json", action="store_true", help="print the figures and verdicts as JSON on stdout")
    pl = table("peerloss", "peer-loss runs: each figure's median and worst, the HSDP join's split")
    _runs_option(pl, "LABEL=FILE, once per suite run; runs that share a label make one row (required)")
    pl.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.table == "mpi":
            cpu = (args.cpu, load(args.cpu)) if args.cpu else None
            result = mpi_table((args.cuda, load(args.cuda)), cpu, args.backend, args.floor, args.start, args.nccl_share,
                               args.min_bytes)  # fmt: skip
            text = render_mpi(result)
        elif args.table == "peerloss":
            result = peerloss_table([(label, path, load(path)) for label, path in args.runs])
            text = render_peerloss(result)
        else:
            if len(set(args.runs)) != len(args.runs):
                twice = sorted({f"{label}={path}" for label, path in args.runs if args.runs.count((label, path)) > 1})
                raise InputError(f"--run {', '.join(twice)} given twice", "name each run's file once (runs that share a label make one row)")
            result = net_table([(label, path, load(path)) for label, path in args.runs], args.baseline, args.start, args.ratio,
                               args.min_bytes)  # fmt: skip
            text = render_net(result)
    except InputError as exc:
        print(f"torch_dist_check.tables: {exc}\n  hint: {exc.hint}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
