"""`hpcml plan memory`: per-device bytes of a training layout."""

from __future__ import annotations

from pathlib import Path

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
    GPU_OPT,
    GRAD_DTYPE_OPT,
    HEADS_OPT,
    HIDDEN_OPT,
    JSON_OPT,
    KV_HEADS_OPT,
    LARGEST_LAYER_OPT,
    LAYERS_OPT,
    MB_OPT,
    MODEL_OPT,
    NODE_OPT,
    OFFLOAD_OPT,
    OPTIM_OPT,
    PARAMS_OPT,
    PP_OPT,
    PRECISION_OPT,
    RECOMPUTE_OPT,
    RESERVE_OPT,
    SCHEDULE_OPT,
    SEQ_OPT,
    SP_OPT,
    SWIGLU_OPT,
    TP_OPT,
    USABLE_OPT,
    VIRTUAL_OPT,
    VOCAB_OPT,
    WEIGHTS_OPT,
    ZERO_OPT,
    _catalog,
    _cluster,
    _gb,
    _layout,
    _model,
    _training,
    app,
)
from hpcml.plan.common import GB, PlanError, human_bytes


@app.command("memory")
def memory_cmd(
    model: str | None = MODEL_OPT,
    args: str = ARGS_OPT,
    params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT,
    hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT,
    seq: int | None = SEQ_OPT,
    vocab: int | None = VOCAB_OPT,
    ffn: int | None = FFN_OPT,
    flops: float | None = FLOPS_OPT,
    kv_heads: int | None = KV_HEADS_OPT,
    swiglu: bool = SWIGLU_OPT,
    largest_layer: float | None = LARGEST_LAYER_OPT,
    devices: int = DEVICES_OPT,
    gpu: str | None = GPU_OPT,
    node: str | None = NODE_OPT,
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
    grad_dtype: str | None = GRAD_DTYPE_OPT,
    reserve_gb: float = RESERVE_OPT,
    usable: float = USABLE_OPT,
    optimizer: str = OPTIM_OPT,
    precision: str = PRECISION_OPT,
    weights: str | None = WEIGHTS_OPT,
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Per-device bytes of parameters, gradients, optimizer states and activations."""
    from hpcml.plan.memory import per_device_bytes

    cat = _catalog(catalog)
    shape = _model(
        model,
        args,
        params,
        layers,
        hidden,
        heads,
        seq,
        vocab,
        ffn,
        flops,
        kv_heads,
        swiglu,
        largest_layer,
    )
    cluster = _cluster(cat, devices, gpu, node, None, None, None, None)
    lay = _layout(tp, pp, zero, sp, schedule, virtual, mb, accum, recompute, offload, attention)
    tr = _training(precision, optimizer, weights, grad_dtype)
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
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "sp": lay.sp,
        "micro_batch": mb,
        "grad_accum": accum,
        "recompute": recompute,
        "offload": offload,
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
    if json_out:
        print_json(out)
        return
    size = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    t = Table(
        title=f"{shape.name} ({size} params) per device: {devices} x "
        f"{cluster.accelerator.key}, dp={dp} tp={tp} pp={pp} ZeRO-{zero}, "
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
