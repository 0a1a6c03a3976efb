"""The bandwidth sweep drawn as a PNG (bus bandwidth against size), if matplotlib is installed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch_dist_check.report import PASS, FAIL, CheckResult


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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"path": path, "written": True, "reason": ""}
