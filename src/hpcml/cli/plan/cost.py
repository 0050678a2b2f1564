"""`hpcml plan cost run`: what a training run costs on each hardware option."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import cost_app
from hpcml.cli.plan.shared import LAYOUT, MODEL, OUTPUT, TRAINING, PlanOptions, plan_options
from hpcml.plan.common import PlanError, human_seconds

# --- cost ------------------------------------------------------------------------------------


@cost_app.command("run")
@plan_options(MODEL, ("devices",), LAYOUT, TRAINING, OUTPUT, drop=("largest_layer",))
def cost_run_cmd(
    opts: PlanOptions,
    tokens: float | None = typer.Option(None, "--tokens", help="Training tokens, e.g. 2e12."),
    steps: int | None = typer.Option(
        None, "--steps", help="Optimizer steps (with --global-batch)."
    ),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Samples per step."),
    gpus: list[str] = typer.Option(
        None, "--gpu", help="Hardware options (repeat; default all GPUs)."
    ),
    mfu: float | None = typer.Option(
        None, "--mfu", help="Model FLOPs utilisation (default per GPU)."
    ),
    price: float | None = typer.Option(None, "--price", help="USD per GPU-hour for every option."),
    provider: str | None = typer.Option(
        None, "--provider", help="Catalog price from this provider."
    ),
) -> None:
    """Tokens or steps -> GPU-hours -> money, per hardware option.

    The layout options are `plan step`'s: recomputation adds its FLOPs (then --mfu is read as
    hardware FLOPs utilisation), and without --mfu each option runs at the MFU `plan step`
    predicts for this layout on it."""
    from hpcml.plan.cost import run_cost
    from hpcml.plan.hardware import resolve_cluster
    from hpcml.plan.perf import step_time

    cat = opts.load_catalog()
    shape = opts.shape()
    lay, tr = opts.layout(), opts.training()
    devices, precision, recompute = opts.devices, opts.precision, opts.recompute
    lay.validate(shape, devices)
    samples = None
    if tokens is None:
        if steps is None or global_batch is None:
            raise PlanError("give the run's length with --tokens, or --steps and --global-batch.")
        samples = float(steps) * global_batch
    keys = gpus or [k for k in cat.accelerators if k != "cpu"]
    accs = [cat.accelerator(k) for k in keys]
    usable = [a for a in accs if _has_precision(a, precision)]
    if not usable:
        raise PlanError(
            f"none of {', '.join(keys)} lists a peak for {precision}; pick another --precision."
        )
    rows = []
    for acc in usable:
        util = mfu
        if util is None:
            est = step_time(shape, lay, tr, resolve_cluster(cat, devices, accelerator=acc.key))
            util = est.hfu if recompute != "none" else est.mfu
        rows += run_cost(
            shape,
            [acc],
            precision,
            devices,
            tokens=tokens,
            samples=samples,
            mfu=min(util, 1.0),
            price_usd_per_gpu_hour=price,
            provider=provider,
            recompute=recompute,
        )
    rows.sort(key=lambda r: (r.cost_usd is None, r.cost_usd or 0.0))
    if opts.json_out:
        print_json(
            {
                "model": shape.name,
                "tokens": tokens,
                "samples": samples,
                "options": [r.to_dict() for r in rows],
            }
        )
        return
    what = f"{tokens:.3g} tokens" if tokens else f"{steps} steps x {global_batch} samples"
    t = Table(
        title=f"cost of training {shape.name} on {what} with {devices} devices "
        f"({rows[0].total_flops:.3g} FLOPs, {precision})"
    )
    for col in ("hardware", "MFU", "GPU-hours", "wall time", "$/GPU-h", "cost", "energy MWh"):
        t.add_column(col, justify="left" if col == "hardware" else "right")
    for r in rows:
        t.add_row(
            r.accelerator,
            f"{r.mfu:.0%}",
            f"{r.gpu_hours:,.0f}",
            human_seconds(r.wall_hours * 3600),
            f"{r.usd_per_gpu_hour:.2f}" if r.usd_per_gpu_hour is not None else "-",
            f"${r.cost_usd:,.0f}" if r.cost_usd is not None else "-",
            f"{r.energy_kwh / 1000:,.1f}",
        )
    console.print(t)
    for r in rows:
        if r.usd_per_gpu_hour is not None:
            console.print(
                f"{r.accelerator}: ${r.usd_per_gpu_hour:.2f}/GPU-h from "
                f"{r.price_provider}" + (f" (as of {r.price_as_of})" if r.price_as_of else "")
            )


def _has_precision(acc: Any, precision: str) -> bool:
    try:
        acc.peak(precision)
    except PlanError:
        return False
    return True
