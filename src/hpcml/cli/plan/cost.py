"""`hpcml plan cost run`: what a training run costs on each hardware option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import (
    ACCUM_OPT,
    ARGS_OPT,
    ATTENTION_OPT,
    CATALOG_OPT,
    DEVICES_OPT,
    FFN_OPT,
    FLOPS_OPT,
    GRAD_DTYPE_OPT,
    HEADS_OPT,
    HIDDEN_OPT,
    JSON_OPT,
    KV_HEADS_OPT,
    LAYERS_OPT,
    MB_OPT,
    MODEL_OPT,
    OFFLOAD_OPT,
    OPTIM_OPT,
    PARAMS_OPT,
    PP_OPT,
    PRECISION_OPT,
    RECOMPUTE_OPT,
    SCHEDULE_OPT,
    SEQ_OPT,
    SP_OPT,
    SWIGLU_OPT,
    TP_OPT,
    VIRTUAL_OPT,
    VOCAB_OPT,
    WEIGHTS_OPT,
    ZERO_OPT,
    _catalog,
    _layout,
    _model,
    _training,
    cost_app,
)
from hpcml.plan.common import PlanError, human_seconds

# --- cost ------------------------------------------------------------------------------------


@cost_app.command("run")
def cost_run_cmd(
    model: str | None = MODEL_OPT,
    args: str = ARGS_OPT,
    params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT,
    hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT,
    seq: int | None = SEQ_OPT,
    vocab: int | None = VOCAB_OPT,
    flops: float | None = FLOPS_OPT,
    ffn: int | None = FFN_OPT,
    kv_heads: int | None = KV_HEADS_OPT,
    swiglu: bool = SWIGLU_OPT,
    tp: int = TP_OPT,
    pp: int = PP_OPT,
    zero: int = ZERO_OPT,
    sp: bool | None = SP_OPT,
    schedule: str = SCHEDULE_OPT,
    virtual: int = VIRTUAL_OPT,
    mb: int = MB_OPT,
    accum: int = ACCUM_OPT,
    recompute: str = RECOMPUTE_OPT,
    offload: str = OFFLOAD_OPT,
    attention: str | None = ATTENTION_OPT,
    optimizer: str = OPTIM_OPT,
    weights: str | None = WEIGHTS_OPT,
    grad_dtype: str | None = GRAD_DTYPE_OPT,
    tokens: float | None = typer.Option(None, "--tokens", help="Training tokens, e.g. 2e12."),
    steps: int | None = typer.Option(
        None, "--steps", help="Optimizer steps (with --global-batch)."
    ),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Samples per step."),
    gpus: list[str] = typer.Option(
        None, "--gpu", help="Hardware options (repeat; default all GPUs)."
    ),
    devices: int = DEVICES_OPT,
    precision: str = PRECISION_OPT,
    mfu: float | None = typer.Option(
        None, "--mfu", help="Model FLOPs utilisation (default per GPU)."
    ),
    price: float | None = typer.Option(None, "--price", help="USD per GPU-hour for every option."),
    provider: str | None = typer.Option(
        None, "--provider", help="Catalog price from this provider."
    ),
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Tokens or steps -> GPU-hours -> money, per hardware option.

    The layout options are `plan step`'s: recomputation adds its FLOPs (then --mfu is read as
    hardware FLOPs utilisation), and without --mfu each option runs at the MFU `plan step`
    predicts for this layout on it."""
    from hpcml.plan.cost import run_cost
    from hpcml.plan.hardware import resolve_cluster
    from hpcml.plan.perf import step_time

    cat = _catalog(catalog)
    shape = _model(
        model, args, params, layers, hidden, heads, seq, vocab, ffn, flops, kv_heads, swiglu
    )
    lay = _layout(tp, pp, zero, sp, schedule, virtual, mb, accum, recompute, offload, attention)
    tr = _training(precision, optimizer, weights, grad_dtype)
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
    if json_out:
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
