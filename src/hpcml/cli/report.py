"""`hpcml report RUN_DIR [RUN_DIR ...]`: an HTML page (and PNGs) for runs, side by side."""

from __future__ import annotations

from pathlib import Path

import typer

from hpcml.cli.common import console, print_json


def report(
    run_dirs: list[Path] = typer.Argument(..., help="Run folders; the first is the baseline."),
    out: Path = typer.Option(Path("report.html"), "--out", help="HTML file to write."),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """One self-contained HTML report of runs: curves, throughput, memory vs prediction, faults,
    speedup and scaling efficiency against the first run."""
    from hpcml.observe.report import write_report

    result = write_report(run_dirs, out)
    if json_out:
        print_json(result)
        return
    console.print(f"wrote {result['report']} ({len(result['figures'])} figures beside it)")
    for row in result["runs"]:
        if row["notes"]:
            console.print(f"note: {row['run']}: {row['notes']}", highlight=False)
