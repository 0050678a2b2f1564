"""`hpcml plan step`: step time, throughput, MFU and a scaling curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import _finish_plot, app
from hpcml.cli.plan.shared import (
    CALIBRATION,
    CLUSTER,
    LAYOUT,
    MODEL,
    OUTPUT,
    TRAINING,
    PlanOptions,
    plan_options,
)
from hpcml.plan.common import PlanError


def _default_counts(devices: int, per_node: int) -> list[int]:
    counts, n = [], 1
    while n < devices:
        counts.append(n)
        n *= 2
    counts.append(devices)
    return sorted(set(counts))


@app.command("step")
@plan_options(MODEL, CLUSTER, LAYOUT, TRAINING, CALIBRATION, OUTPUT)
def step_cmd(
    opts: PlanOptions,
    scaling: str | None = typer.Option(
        None, "--scaling", help="Device counts for the scaling curve, e.g. 8,16,32,64."
    ),
    global_batch: int | None = typer.Option(
        None, "--global-batch", help="Fix samples per step (strong scaling) in the curve."
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write the scaling curve as PNG."),
) -> None:
    """Predicted step time, throughput and MFU, and a scaling curve over device counts."""
    from hpcml.plan.interval import no_interval_reason, step_interval
    from hpcml.plan.perf import scaling_curve, step_time

    cat = opts.load_catalog()
    shape = opts.shape()
    cluster = opts.cluster(cat)
    lay, tr = opts.layout(), opts.training()
    cal = opts.calibration(cluster)
    devices, overlap = opts.devices, opts.overlap
    est = step_time(shape, lay, tr, cluster, cal, overlap)
    interval = step_interval(est.step_s, cal)
    try:
        counts = (
            [int(x) for x in scaling.split(",") if x.strip()]
            if scaling
            else _default_counts(devices, cluster.devices_per_node)
        )
    except ValueError:
        raise PlanError(f"--scaling '{scaling}' must be comma-separated integers.") from None
    curve = scaling_curve(shape, lay, tr, cluster, counts, global_batch, cal, overlap)
    base = curve[0]
    rows: list[dict[str, Any]] = [
        {
            "devices": e.devices,
            "step_s": e.step_s,
            "step_interval_s": _ends(step_interval(e.step_s, cal)),
            "samples_per_s": e.samples_per_s,
            "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu,
            "speedup": e.samples_per_s / base.samples_per_s,
            "scaling_efficiency": (e.samples_per_s / base.samples_per_s)
            / (e.devices / base.devices),
        }
        for e in curve
    ]
    if plot:
        _plot_scaling(rows, plot, f"{shape.name} on {cluster.accelerator.key}")
    if opts.json_out:
        print_json(
            {
                "model": shape.name,
                "cluster": cluster.describe(),
                "calibration": cal.to_dict(),
                "step": est.to_dict(),
                "step_interval": None if interval is None else interval.to_dict(),
                "no_interval_reason": None if interval else no_interval_reason(cal),
                "scaling": rows,
                "plot": str(plot) if plot else None,
            }
        )
        return
    t = Table(
        title=f"{shape.name} step on {cluster.describe()}: dp={est.dp} tp={lay.tp} pp={lay.pp} "
        f"ZeRO-{lay.zero}, micro-batch {lay.micro_batch} x {lay.grad_accum}, "
        f"recompute {lay.recompute}"
    )
    t.add_column("term")
    t.add_column("seconds", justify="right")
    for label, value in (
        ("compute (at efficiency %.0f%%)" % (cal.efficiency * 100), est.compute_s),
        ("communication on the critical path", est.critical_comm_s),
        ("pipeline bubble", est.bubble_s),
        ("data-parallel comm (total)", est.dp_comm_s),
        ("data-parallel comm (exposed)", est.exposed_dp_comm_s),
        ("optimizer step", est.optimizer_s),
        ("fixed overhead (per step and per collective)", est.overhead_s),
        ("= step", est.step_s),
    ):
        t.add_row(label, f"{value:.4f}")
    console.print(t)
    rate = (
        f"{est.tokens_per_s:,.0f} tokens/s"
        if shape.is_transformer
        else f"{est.samples_per_s:,.1f} samples/s"
    )
    console.print(f"{rate}, MFU {est.mfu:.1%} (HFU {est.hfu:.1%})")
    if interval is None:
        console.print(f"step time {est.step_s:.4g} s, no interval: {no_interval_reason(cal)}")
    else:
        console.print(
            f"step time {est.step_s:.4g} s, {interval.level:.0%} interval "
            f"{interval.low_s:.4g} .. {interval.high_s:.4g} s ({interval.basis})"
        )
    t = Table(
        title="scaling" + (" (fixed global batch)" if global_batch else " (fixed per-device batch)")
    )
    for col in (
        "devices",
        "step s",
        "90% interval",
        "samples/s",
        "tokens/s",
        "MFU",
        "speedup",
        "efficiency",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        span = r["step_interval_s"]
        t.add_row(
            str(r["devices"]),
            f"{r['step_s']:.4f}",
            "-" if span is None else f"{span[0]:.4f} .. {span[1]:.4f}",
            f"{r['samples_per_s']:,.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}",
            f"{r['speedup']:.2f}",
            f"{r['scaling_efficiency']:.0%}",
        )
    console.print(t)
    if plot:
        console.print(f"plot written to {plot}")


def _ends(interval: Any) -> list[float] | None:
    return None if interval is None else [interval.low_s, interval.high_s]


def _plot_scaling(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["devices"] for r in rows]
    ax.plot(n, [r["speedup"] for r in rows], "o-", label="predicted")
    ax.plot(n, [x / n[0] for x in n], "--", color="grey", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("throughput speedup")
    _finish_plot(fig, ax, title, path)
