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
from hpcml.plan.common import PlanError


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
    run_dirs: list[Path] = typer.Argument(..., help="Run folders with summary.json."),
    calibrate_with: list[Path] = typer.Option(
        None, "--calibrate-with", help="Other run folders on the same hardware (repeat)."
    ),
    loo: bool = typer.Option(
        False,
        "--leave-one-model-out",
        help="Calibrate each run's step time on the runs of the other models given.",
    ),
    efficiency: float | None = EFF_OPT,
    overhead: float = OVERHEAD_OPT,
    include_data_wait: bool = typer.Option(
        False, "--include-data-wait", help="Compare against step time with the data wait."
    ),
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Predict measured runs and print prediction, measurement and their ratio."""
    from hpcml.plan.check import check_run, leave_one_model_out, setup_from_summary
    from hpcml.plan.perf import Calibration

    cat = _catalog(catalog)
    setups = [setup_from_summary(_read_run(p), cat, str(p), include_data_wait) for p in run_dirs]
    if loo:
        if calibrate_with or efficiency is not None:
            raise PlanError(
                "--leave-one-model-out fits its own calibrations; drop --calibrate-with and "
                "--efficiency."
            )
        from hpcml.plan.floor import floors

        reports = leave_one_model_out(setups)
        bounds = floors(setups)
        if json_out:
            print_json({"reports": [r.to_dict() for r in reports], "floors": bounds})
            return
        _print_summary_table(reports)
        _print_floors(bounds)
        return
    if len(setups) != 1:
        raise PlanError(
            f"{len(setups)} run folders given; check one run, or pass --leave-one-model-out "
            "to check several against each other."
        )
    setup = setups[0]
    resolved = {p.resolve() for p in calibrate_with or []}
    if run_dirs[0].resolve() in resolved:
        raise PlanError(
            f"{run_dirs[0]} is also in --calibrate-with: a run calibrated on itself agrees with "
            "itself by construction; calibrate on other runs of this hardware."
        )
    others = [
        setup_from_summary(_read_run(p), cat, str(p), include_data_wait)
        for p in calibrate_with or []
    ]
    cal = Calibration(efficiency, overhead, "--efficiency") if efficiency is not None else None
    report = check_run(setup, others, cal)
    if json_out:
        print_json(report.to_dict())
        return
    _print_report(report, run_dirs[0])


def _print_summary_table(reports: list[Any]) -> None:
    quantities = (
        "model_states_bytes",
        "activations_bytes",
        "states_plus_activations_bytes",
        "step_time_s",
    )
    t = Table(title="predicted / measured, step time calibrated on the other models' runs")
    for col in ("run", "model", "world", "zero", "tp", *quantities):
        t.add_column(col.replace("_bytes", ""), justify="left" if col == "run" else "right")
    for rep in reports:
        d = rep.to_dict()
        ratios = {r.quantity: r for r in rep.rows}
        cells = []
        for q in quantities:
            r = ratios.get(q)
            cells.append(
                "-" if r is None or r.ratio is None else f"{r.ratio:.3f}{'' if r.ok else ' MISS'}"
            )
        t.add_row(
            Path(d["run"]).name,
            d["model"],
            str(d["world_size"]),
            str(d["zero"]),
            str(rep.setup.layout.tp),
            *cells,
        )
    console.print(t)


def _print_floors(bounds: list[dict[str, Any]]) -> None:
    """The best any single calibration could do on these runs (hpcml.plan.floor)."""
    for b in bounds:
        console.print(
            f"in-sample floor on {b['accelerator']} ({b['runs']} runs): no single calibration "
            f"puts every run within {b['worst']:.1%} (fitted on all of them; the worst rows: "
            f"{', '.join(Path(x).name for x in b['binding'])})"
        )
        for label, m in b["per_model"].items():
            console.print(
                f"  {label}: its own {m['runs']} run(s) leave at least {m['worst']:.1%} "
                "for any calibration, fitted on other models or on itself"
            )


def _print_report(report: Any, run_dir: Path) -> None:
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
        f"{cal_d.overhead_s * 1e3:.2f} ms/step, "
        f"{cal_d.collective_overhead_s * 1e3:.2f} ms per collective, "
        f"{cal_d.tensor_overhead_s * 1e3:.3f} ms per parameter tensor "
        f"(+{cal_d.tp_tensor_overhead_s * 1e3:.3f} under TP) ({cal_d.source})"
    )
    for note in report.notes:
        console.print(f"note: {note}")
