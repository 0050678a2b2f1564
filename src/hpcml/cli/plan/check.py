"""`hpcml plan check`: predictions next to measured runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import (
    CATALOG_OPT,
    EFF_OPT,
    JSON_OPT,
    OVERHEAD_OPT,
    _catalog,
    app,
)


def _read_run(run_dir: Path) -> dict[str, Any]:
    from hpcml.errors import RunDirError
    from hpcml.records import read_summary

    path = run_dir / "summary.json"
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} has no summary.json; pass a folder `hpcml train` finished "
            "(or let it finish)."
        )
    try:
        return read_summary(run_dir)
    except json.JSONDecodeError:
        raise RunDirError(
            f"{path} is not valid JSON; the run may have been cut off while writing it."
        ) from None


@app.command("check")
def check_cmd(
    run_dir: Path = typer.Argument(..., help="Run folder with summary.json."),
    calibrate_with: list[Path] = typer.Option(
        None, "--calibrate-with", help="Other run folders on the same hardware (repeat)."
    ),
    efficiency: float | None = EFF_OPT,
    overhead: float = OVERHEAD_OPT,
    include_data_wait: bool = typer.Option(
        False, "--include-data-wait", help="Compare against step time with the data wait."
    ),
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Predict a measured run and print prediction, measurement and their ratio."""
    from hpcml.plan.check import check_run, setup_from_summary
    from hpcml.plan.perf import Calibration

    cat = _catalog(catalog)
    setup = setup_from_summary(_read_run(run_dir), cat, str(run_dir), include_data_wait)
    others = [
        setup_from_summary(_read_run(p), cat, str(p), include_data_wait)
        for p in calibrate_with or []
    ]
    cal = Calibration(efficiency, overhead, "--efficiency") if efficiency is not None else None
    report = check_run(setup, others, cal)
    if json_out:
        print_json(report.to_dict())
        return
    d = report.to_dict()
    t = Table(
        title=f"{run_dir}: {d['model']} ({d['parameters']:,} params) on {d['world_size']} x "
        f"{d['accelerator']}, {d['precision']}/{d['weights']} {d['optimizer']}, "
        f"micro-batch {d['micro_batch']}"
    )
    for col in ("quantity", "predicted", "measured", "predicted / measured", "goal"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for r in report.rows:
        fmt = (
            (lambda v: "-" if v is None else f"{v * 1e3:.2f} ms")
            if r.quantity.endswith("_s")
            else (lambda v: "-" if v is None else f"{v:,.0f}")
        )
        ratio = r.ratio
        mark = "" if r.ok is None else (" ok" if r.ok else " MISS")
        t.add_row(
            r.quantity,
            fmt(r.predicted),
            fmt(r.measured),
            "-" if ratio is None else f"{ratio:.3f}{mark}",
            f"±{r.goal:.0%}",
        )
    console.print(t)
    cal_d = report.calibration
    console.print(
        f"calibration: efficiency {cal_d.efficiency:.3g}, overhead "
        f"{cal_d.overhead_s * 1e3:.2f} ms/step ({cal_d.source})"
    )
    for note in report.notes:
        console.print(f"note: {note}")
