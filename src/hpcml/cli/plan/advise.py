"""`hpcml plan advise`: the fastest layouts that fit."""

from __future__ import annotations

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import RESERVE_OPT, _short, app
from hpcml.cli.plan.shared import (
    CALIBRATION,
    CLUSTER,
    MODEL,
    OUTPUT,
    TRAINING,
    PlanOptions,
    plan_options,
)
from hpcml.plan.common import GB


@app.command("advise")
@plan_options(MODEL, CLUSTER, TRAINING, CALIBRATION, OUTPUT)
def advise_cmd(
    opts: PlanOptions,
    global_batch: int = typer.Option(..., "--global-batch", help="Samples (sequences) per step."),
    reserve_gb: float = RESERVE_OPT,
    top: int = typer.Option(5, "--top", help="How many layouts to show."),
    usable: float = typer.Option(0.9, "--usable", help="Share of device memory a plan may use."),
    allow_offload: bool = typer.Option(False, "--allow-offload", help="Also try CPU offload."),
) -> None:
    """Search data/tensor/pipeline degrees, ZeRO, micro-batch and recomputation; rank by speed."""
    from hpcml.plan.advise import advise

    cat = opts.load_catalog()
    shape = opts.shape()
    cluster = opts.cluster(cat)
    tr = opts.training()
    cal = opts.calibration(cluster)
    result = advise(
        shape,
        tr,
        cluster,
        global_batch,
        top=top,
        usable_fraction=usable,
        reserve_bytes=reserve_gb * GB,
        calibration=cal,
        overlap=opts.overlap,
        offload=("none", "optimizer", "params") if allow_offload else ("none",),
    )
    if opts.json_out:
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
            lay.recompute,
            f"{c.memory.total_bytes / GB:.1f}",
            f"{e.step_s:.3g}",
            f"{e.exposed_comm_s:.2g}",
            _short(e.tokens_per_s if shape.is_transformer else e.samples_per_s),
            f"{e.mfu:.0%}",
        )
    console.print(t)
    console.print(result.why)
