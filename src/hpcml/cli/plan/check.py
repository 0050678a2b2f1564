"""`hpcml plan check`: predictions next to measured runs."""

from __future__ import annotations

import json
from dataclasses import replace
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
    save: Path | None = typer.Option(
        None,
        "--save-calibration",
        help="Write the calibration fitted on the runs (with --leave-one-model-out: all of "
        "them; else the --calibrate-with runs) for plan step / advise --calibration.",
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
        if save is not None:
            _save_calibration(save, setups)
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
    setup = replace(setups[0], label=str(run_dirs[0].resolve()))
    others = [
        setup_from_summary(_read_run(p), cat, str(p.resolve()), include_data_wait)
        for p in calibrate_with or []
    ]
    cal = Calibration(efficiency, overhead, "--efficiency") if efficiency is not None else None
    report = check_run(setup, others, cal)
    if save is not None:
        _save_calibration(save, others, report.calibration if others and cal is None else None)
    if json_out:
        print_json(report.to_dict())
        return
    _print_report(report, run_dirs[0])


def _save_calibration(path: Path, setups: list[Any], cal: Any = None) -> None:
    """The calibration of `setups` (one hardware; `cal` where it is fitted already), with its
    errors out of sample, as JSON."""
    from hpcml.plan.check import calibrate_from

    if not setups:
        raise PlanError(
            "--save-calibration fits the --calibrate-with runs, or every run with "
            "--leave-one-model-out; give one of them."
        )
    accelerators = sorted({s.cluster.accelerator.key for s in setups})
    if len(accelerators) > 1:
        raise PlanError(
            f"--save-calibration fits one hardware; the runs ran on {', '.join(accelerators)}."
        )
    cal = cal or calibrate_from(setups)
    doc = {
        "accelerator": accelerators[0],
        "runs": [s.label for s in setups],
        "calibration": cal.to_dict(),
    }
    try:
        path.write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        raise PlanError(
            f"--save-calibration {path} cannot be written ({exc.strerror or exc}); give a "
            "writable file."
        ) from None


def _print_summary_table(reports: list[Any]) -> None:
    quantities = (
        "model_states_bytes",
        "activations_bytes",
        "states_plus_activations_bytes",
        "peak_bytes",
        "step_time_s",
    )
    t = Table(title="predicted / measured, step time calibrated on the other models' runs")
    for col in ("run", "model", "world", "zero", "tp", *quantities, "90% interval / measured"):
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
            _interval_cell(ratios.get("step_time_s")),
        )
    console.print(t)
    rows = [r for rep in reports for r in rep.rows if r.quantity == "step_time_s" and r.interval]
    if rows:
        inside = sum(r.interval.contains(r.measured) for r in rows if r.measured)
        console.print(f"measured step time inside its 90% interval: {inside} of {len(rows)} runs")


def _interval_cell(row: Any) -> str:
    """The interval's ends over the measured step time, and whether it holds it."""
    if row is None or row.interval is None or not row.measured:
        return "-"
    iv, m = row.interval, row.measured
    return f"{iv.low_s / m:.2f} .. {iv.high_s / m:.2f}{'' if iv.contains(m) else ' OUT'}"


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


def describe_calibration(cal: Any) -> str:
    """One line: the efficiency, each software cost, the noise, what it was fitted on."""
    kinds = ", ".join(f"{op} {v * 1e3:.2f}" for op, v in cal.collective_costs_s)
    mean = cal.collective_overhead_s * 1e3
    per_call = (
        f"ms per collective call: {kinds} (other kinds {mean:.2f})"
        if kinds
        else f"{mean:.2f} ms per collective"
    )
    noise = "" if cal.noise_log is None else f", run-to-run noise {cal.noise_log:.1%}"
    return (
        f"efficiency {cal.efficiency:.3g}, overhead {cal.overhead_s * 1e3:.2f} ms/step, "
        f"{per_call}, "
        f"{cal.tensor_overhead_s * 1e3:.3f} ms per parameter tensor "
        f"(+{cal.tp_tensor_overhead_s * 1e3:.3f} under TP){noise} ({cal.source})"
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
    step = next(r for r in report.rows if r.quantity == "step_time_s")
    if step.interval is not None:
        iv = step.interval
        where = (
            ""
            if step.measured is None
            else f"; measured {'inside' if iv.contains(step.measured) else 'OUTSIDE'}"
        )
        console.print(
            f"step time {step.predicted * 1e3:.2f} ms, {iv.level:.0%} interval "
            f"{iv.low_s * 1e3:.2f} .. {iv.high_s * 1e3:.2f} ms{where} ({iv.basis})"
        )
    console.print(f"calibration: {describe_calibration(report.calibration)}")
    for note in report.notes:
        console.print(f"note: {note}")
