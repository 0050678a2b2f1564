"""`hpcml plan memory`: per-device bytes of a training layout."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import RESERVE_OPT, USABLE_OPT, _gb, app
from hpcml.cli.plan.shared import LAYOUT, MODEL, OUTPUT, TRAINING, PlanOptions, plan_options
from hpcml.plan.common import GB, PlanError

TRACE_OPT = typer.Option(
    None,
    "--trace",
    help="A training config (YAML): build its model on fake tensors and trace one step's "
    "memory under torch's MemTracker; the layout and training options come from the config.",
)
OVERRIDES_ARG = typer.Argument(None, help="key=value overrides of the --trace config.")


@app.command("memory")
@plan_options(MODEL, ("devices", "gpu", "node"), LAYOUT, TRAINING, OUTPUT)
def memory_cmd(
    opts: PlanOptions,
    overrides: list[str] | None = OVERRIDES_ARG,
    trace: Path | None = TRACE_OPT,
    reserve_gb: float = RESERVE_OPT,
    usable: float = USABLE_OPT,
) -> None:
    """Per-device bytes of parameters, gradients, optimizer states and activations."""
    from hpcml.plan.headroom import headroom_verdict
    from hpcml.plan.memory import per_device_bytes

    if reserve_gb < 0 or not 0 < usable <= 1:
        raise PlanError("--reserve-gb must be at least 0 and --usable lie in (0, 1].")
    if trace is not None:
        from hpcml.cli.plan.trace import trace_cmd

        trace_cmd(opts, trace, overrides or [], reserve_gb * GB, usable)
        return
    if overrides:
        raise PlanError(
            f"{' '.join(overrides)}: key=value overrides change a --trace config; pass "
            "--trace CONFIG or drop them."
        )
    cat = opts.load_catalog()
    shape = opts.shape()
    cluster = opts.cluster(cat)
    lay, tr, devices = opts.layout(), opts.training(), opts.devices
    mem = per_device_bytes(shape, lay, tr, devices, cluster.accelerator.memory_bytes)
    dp = lay.dp(devices)
    reserve = reserve_gb * GB
    fits = mem.fits(usable, reserve)
    budget = mem.budget_bytes(usable, reserve)
    verdict, thin = headroom_verdict(mem.total_bytes, budget)
    out = {
        "model": shape.name,
        "parameters": shape.params,
        "devices": devices,
        "dp": dp,
        "tp": lay.tp,
        "pp": lay.pp,
        "zero": lay.zero,
        "sp": lay.sp,
        "micro_batch": lay.micro_batch,
        "grad_accum": lay.grad_accum,
        "recompute": lay.recompute,
        "offload": lay.offload,
        "precision": tr.precision,
        "weights": tr.weight_mode,
        "optimizer": tr.optimizer,
        "accelerator": cluster.accelerator.key,
        "attention": (lay.attention or shape.attention) if shape.is_transformer else None,
        "grad_dtype": tr.grad_dtype,
        "reserve_bytes": reserve,
        "usable_fraction": usable,
        "fits": fits,
        "budget_bytes": budget,
        "headroom_bytes": None if budget is None else budget - mem.total_bytes,
        "thin_headroom": thin,
        **mem.to_dict(),
    }
    if opts.json_out:
        print_json(out)
        return
    size = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    t = Table(
        title=f"{shape.name} ({size} params) per device: {devices} x "
        f"{cluster.accelerator.key}, dp={dp} tp={lay.tp} pp={lay.pp} ZeRO-{lay.zero}, "
        f"{tr.precision}/{tr.weight_mode} {tr.optimizer}"
    )
    t.add_column("part")
    t.add_column("GB", justify="right")
    for label, key in (
        ("parameters", "params_bytes"),
        ("gradients", "grads_bytes"),
        ("optimizer states", "optimizer_bytes"),
        ("= model states", "model_states_bytes"),
        ("activations", "activations_bytes"),
        ("communication buffers", "buffers_bytes"),
        ("optimizer temporaries", "optimizer_temp_bytes"),
        ("= peak total", "total_bytes"),
        ("step peak, phase by phase (plan check's peak_bytes)", "step_peak_bytes"),
        ("offloaded to host", "host_bytes"),
    ):
        t.add_row(label, _gb(out[key]))
    cap = cluster.accelerator.memory_bytes
    t.add_row("device memory", _gb(cap))
    console.print(t)
    console.print(budget_line(verdict, cap, usable, reserve))
    for note in mem.notes:
        console.print(f"note: {note}")


def budget_line(verdict: str, cap: int | None, usable: float, reserve: float) -> str:
    """The verdict and the budget it was measured against."""
    from hpcml.plan.common import human_bytes

    if not cap:
        return verdict
    return (
        f"{verdict}; budget: {usable:.0%} of {human_bytes(cap)} less {human_bytes(reserve)} for "
        "the CUDA context"
    )
