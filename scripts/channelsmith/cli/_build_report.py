"""A build's report for people (a table and notes) and for scripts (the --json document), shown alike
after a direct build (`channelsmith build`) and after collecting batch jobs (`build --collect`)."""

from __future__ import annotations

from typing import Any

from channelsmith.build import BuildReport
from channelsmith.cli._output import Output


def present(report: BuildReport, out: Output) -> None:
    """The summary table (or the JSON document with the same content)."""
    if out.json_mode:
        out.json(report_document(report))
        return
    out.table(
        f"build into {report.channel}",
        ("recipe", "package", "version", "build string", "variant", "seconds", "result"),
        _rows(report),
    )
    if report.published:
        out.note(f"published {len(report.published)} package(s) into {report.channel} (indexed)")
    kept = sum(len(r.in_channel) for r in report.results)
    if kept:
        out.note(
            f"{kept} package(s) were already in the channel and were not built again "
            "(a package file never changes: bump the recipe's build number to rebuild)"
        )


def report_document(report: BuildReport) -> dict[str, Any]:
    """The --json document: every engine call with its packages, and what was published."""
    return {
        "channel": str(report.channel),
        "ok": report.ok,
        "published": [str(p) for p in report.published],
        "builds": [
            {
                "recipe": r.recipe,
                "variant": r.variant,
                "result": "ok" if r.ok else "failed",
                "seconds": round(r.seconds, 2),
                "error": r.error,
                "packages": [
                    {"name": p.name, "version": p.version, "build_string": p.build_string, "subdir": p.subdir,
                     "file": p.file.name}
                    for p in r.packages
                ],
                "already_in_channel": [
                    {"name": name, "version": version, "build_string": build_string}
                    for name, version, build_string in r.in_channel
                ],
            }
            for r in report.results
        ],
    }


def _rows(report: BuildReport) -> list[tuple[str, ...]]:
    rows = []
    for result in report.results:
        variant = " ".join(f"{k}={v}" for k, v in sorted(result.distinguishing.items()))
        outcome = "ok" if result.ok else "FAILED"
        seconds = f"{result.seconds:.1f}"
        if not result.packages and not result.in_channel:
            rows.append((result.recipe, "-", "-", "-", variant, seconds, outcome))
        for package in result.packages:
            rows.append(
                (result.recipe, package.name, package.version, package.build_string, variant, seconds, outcome)
            )
        for name, version, build_string in result.in_channel:
            rows.append((result.recipe, name, version, build_string, variant, "-", "in channel"))
    return rows
