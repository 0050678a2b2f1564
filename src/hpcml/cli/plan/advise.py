"""`hpcml plan advise`: the fastest layouts that fit."""

from __future__ import annotations

from typing import Any

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
    from hpcml.plan.headroom import headroom_verdict
    from hpcml.plan.interval import no_interval_reason, step_interval

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
                    {
                        "label": c.label(),
                        "memory": c.memory.to_dict(),
                        "headroom_bytes": None
                        if result.usable_bytes is None
                        else result.usable_bytes - c.memory.total_bytes,
                        "thin_headroom": headroom_verdict(
                            c.memory.total_bytes, result.usable_bytes
                        )[1],
                        "step": c.estimate.to_dict(),
                        "step_interval": _interval_dict(step_interval(c.estimate.step_s, cal)),
                    }
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
        "headroom",
        "step s",
        "90% interval",
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
            _headroom_cell(c.memory.total_bytes, result.usable_bytes),
            f"{e.step_s:.3g}",
            _interval_cell(step_interval(e.step_s, cal)),
            f"{e.exposed_comm_s:.2g}",
            _short(e.tokens_per_s if shape.is_transformer else e.samples_per_s),
            f"{e.mfu:.0%}",
        )
    console.print(t)
    console.print(result.why)
    if step_interval(result.candidates[0].estimate.step_s, cal) is None:
        console.print(f"step times without an interval: {no_interval_reason(cal)}")


def _headroom_cell(total: float, usable: float | None) -> str:
    """The share of the budget left, flagged where it is thin (hpcml.plan.headroom)."""
    from hpcml.plan.headroom import THIN_HEADROOM

    if usable is None or usable <= 0:
        return "-"
    share = (usable - total) / usable
    return f"{share:.0%}" + (" thin" if share < THIN_HEADROOM else "")


def _interval_cell(iv: Any) -> str:
    return "-" if iv is None else f"{iv.low_s:.3g} .. {iv.high_s:.3g}"


def _interval_dict(iv: Any) -> dict[str, Any] | None:
    return None if iv is None else iv.to_dict()
