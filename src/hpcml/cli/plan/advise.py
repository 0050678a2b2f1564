"""`hpcml plan advise`: the fastest layouts that fit."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import (
    ARGS_OPT,
    CATALOG_OPT,
    DEVICES_OPT,
    EFF_OPT,
    FFN_OPT,
    FLOPS_OPT,
    GPU_OPT,
    GRAD_DTYPE_OPT,
    HEADS_OPT,
    HIDDEN_OPT,
    INTER_OPT,
    INTRA_OPT,
    JSON_OPT,
    KV_HEADS_OPT,
    LARGEST_LAYER_OPT,
    LAYERS_OPT,
    MODEL_OPT,
    NICS_OPT,
    NODE_OPT,
    OPTIM_OPT,
    OVERHEAD_OPT,
    OVERLAP_OPT,
    PARAMS_OPT,
    PER_NODE_OPT,
    PRECISION_OPT,
    RESERVE_OPT,
    SEQ_OPT,
    SWIGLU_OPT,
    VOCAB_OPT,
    WEIGHTS_OPT,
    _calibration,
    _catalog,
    _cluster,
    _model,
    _short,
    _training,
    app,
)
from hpcml.plan.common import GB


@app.command("advise")
def advise_cmd(
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
    per_node: int | None = PER_NODE_OPT,
    intra: str | None = INTRA_OPT,
    inter: str | None = INTER_OPT,
    nics: int | None = NICS_OPT,
    global_batch: int = typer.Option(..., "--global-batch", help="Samples (sequences) per step."),
    optimizer: str = OPTIM_OPT,
    precision: str = PRECISION_OPT,
    weights: str | None = WEIGHTS_OPT,
    grad_dtype: str | None = GRAD_DTYPE_OPT,
    reserve_gb: float = RESERVE_OPT,
    efficiency: float | None = EFF_OPT,
    overhead: float = OVERHEAD_OPT,
    overlap: float = OVERLAP_OPT,
    top: int = typer.Option(5, "--top", help="How many layouts to show."),
    usable: float = typer.Option(0.9, "--usable", help="Share of device memory a plan may use."),
    allow_offload: bool = typer.Option(False, "--allow-offload", help="Also try CPU offload."),
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Search data/tensor/pipeline degrees, ZeRO, micro-batch and recomputation; rank by speed."""
    from hpcml.plan.advise import advise

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
    cluster = _cluster(cat, devices, gpu, node, per_node, intra, inter, nics)
    tr = _training(precision, optimizer, weights, grad_dtype)
    cal = _calibration(cluster, efficiency, overhead)
    result = advise(
        shape,
        tr,
        cluster,
        global_batch,
        top=top,
        usable_fraction=usable,
        reserve_bytes=reserve_gb * GB,
        calibration=cal,
        overlap=overlap,
        offload=("none", "optimizer", "params") if allow_offload else ("none",),
    )
    if json_out:
        print_json(
            {
                "model": shape.name,
                "cluster": cluster.describe(),
                "global_batch": global_batch,
                "considered": result.considered,
                "rejected_memory": result.rejected_memory,
                "usable_bytes": result.usable_bytes,
                "why": result.why,
                "candidates": [
                    {"label": c.label(), "memory": c.memory.to_dict(), "step": c.estimate.to_dict()}
                    for c in result.candidates
                ],
            }
        )
        return
    t = Table(
        title=f"best layouts for {shape.name}, global batch {global_batch}, on "
        f"{cluster.describe()}: {result.considered} tried, {result.rejected_memory} "
        "did not fit"
    )
    for col in (
        "#",
        "dp",
        "tp",
        "pp",
        "ZeRO",
        "mb x m",
        "recompute",
        "GB",
        "step s",
        "comm s",
        "tok/s" if shape.is_transformer else "smp/s",
        "MFU",
    ):
        t.add_column(col, justify="right")
    for i, c in enumerate(result.candidates, 1):
        e, lay = c.estimate, c.layout
        t.add_row(
            str(i),
            str(e.dp),
            f"{lay.tp}{'+sp' if lay.sp else ''}",
            f"{lay.pp}{'x' + str(lay.virtual_stages) if lay.schedule == 'interleaved' else ''}",
            str(lay.zero),
            f"{lay.micro_batch}x{lay.grad_accum}",
            lay.recompute[:3],
            f"{c.memory.total_bytes / GB:.1f}",
            f"{e.step_s:.3g}",
            f"{e.exposed_comm_s:.2g}",
            _short(e.tokens_per_s if shape.is_transformer else e.samples_per_s),
            f"{e.mfu:.0%}",
        )
    console.print(t)
    console.print(result.why)
