"""`hpcml plan memory`: per-device bytes of a training layout."""

from __future__ import annotations

from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import RESERVE_OPT, USABLE_OPT, _gb, app
from hpcml.cli.plan.shared import LAYOUT, MODEL, OUTPUT, TRAINING, PlanOptions, plan_options
from hpcml.plan.common import GB, PlanError, human_bytes


@app.command("memory")
@plan_options(MODEL, ("devices", "gpu", "node"), LAYOUT, TRAINING, OUTPUT)
def memory_cmd(
    opts: PlanOptions,
    reserve_gb: float = RESERVE_OPT,
    usable: float = USABLE_OPT,
) -> None:
    """Per-device bytes of parameters, gradients, optimizer states and activations."""
    from hpcml.plan.memory import per_device_bytes

    cat = opts.load_catalog()
    shape = opts.shape()
    cluster = opts.cluster(cat)
    lay, tr, devices = opts.layout(), opts.training(), opts.devices
    mem = per_device_bytes(shape, lay, tr, devices, cluster.accelerator.memory_bytes)
    dp = lay.dp(devices)
    if reserve_gb < 0 or not 0 < usable <= 1:
        raise PlanError("--reserve-gb must be at least 0 and --usable lie in (0, 1].")
    reserve = reserve_gb * GB
    fits = mem.fits(usable, reserve)
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
        ("offloaded to host", "host_bytes"),
    ):
        t.add_row(label, _gb(out[key]))
    cap = cluster.accelerator.memory_bytes
    t.add_row("device memory", _gb(cap))
    console.print(t)
    verdict = "fits" if fits else "does NOT fit"
    console.print(
        f"{verdict} in {usable:.0%} of {human_bytes(cap)} less {human_bytes(reserve)} for the "
        "CUDA context"
        if cap
        else "host memory: not checked"
    )
    for note in mem.notes:
        console.print(f"note: {note}")
