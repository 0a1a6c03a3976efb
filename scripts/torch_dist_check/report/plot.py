"""The bandwidth sweep drawn as a PNG (bus bandwidth against size), if matplotlib is installed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_dist_check.report.results import FAIL, PASS, CheckResult, OutputProblem, output_path_problem


def plot_path_problem(path: str) -> OutputProblem | None:
    """Why ``--plot path`` cannot be written (the folder, or a file type matplotlib cannot draw), or None.

    Without matplotlib only the folder is looked at: the run then says the plot was not drawn, and why.
    """
    problem = output_path_problem("--plot", path)
    if problem is not None:
        return problem
    suffix = Path(path).suffix.lstrip(".").lower()
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return None
    # matplotlib takes the format from the suffix and draws a PNG when there is none.
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix and suffix not in formats:
        return OutputProblem(f"--plot {path}: matplotlib cannot write .{suffix} files",
                             f"use one of .{', .'.join(sorted(formats))}, e.g. {Path(path).with_suffix('.png')}")  # fmt: skip
    return None


def plot_sweeps(results: Sequence[CheckResult], path: str) -> dict[str, Any]:
    """Draw every bandwidth check's rows into ``path``; says whether it was written and why not."""
    sweeps = [r for r in results if r.name.startswith("bandwidth/") and r.status in (PASS, FAIL) and r.details.get("rows")]
    if not sweeps:
        return {"path": path, "written": False, "reason": "no bandwidth figures to plot"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"path": path, "written": False, "reason": "matplotlib is not installed (pip install matplotlib)"}

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for result in sweeps:
        label_prefix = result.name.removeprefix("bandwidth/")
        rows = result.details["rows"]
        for collective in dict.fromkeys(r["collective"] for r in rows):
            mine = [r for r in rows if r["collective"] == collective]
            ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o", markersize=3,
                    label=f"{label_prefix} {collective}")  # fmt: skip
    ax.set_xscale("log", base=2)
    # Log scale: CPU (gloo) and GPU (NCCL) bandwidths differ by two orders of magnitude.
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes; largest buffer, as nccl-tests)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("torch_dist_check bandwidth sweep")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        # Checked before the run; a folder removed since or a full disk must not cost the run's verdict.
        return {"path": path, "written": False, "reason": f"cannot write {path}: {exc}"}
    finally:
        plt.close(fig)
    return {"path": path, "written": True, "reason": ""}
