"""`hpcml plan comm`: time of collectives on a cluster."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import app, parse_size
from hpcml.cli.plan.shared import CLUSTER, MODEL, OUTPUT, PlanOptions, plan_options
from hpcml.plan.common import PlanError, human_bytes, human_seconds

# --- comm ------------------------------------------------------------------------------------


@app.command("comm")
@plan_options(
    CLUSTER,
    MODEL,
    ("mb", "accum", "precision", "weights"),
    OUTPUT,
    drop=("devices", "ffn", "flops", "kv_heads", "swiglu", "largest_layer"),
)
def comm_cmd(
    opts: PlanOptions,
    size: str = typer.Option("256MB", "--size", help="Message size S (nccl-tests' size)."),
    op: str | None = typer.Option(None, "--op", help="One collective (default: all)."),
    algorithm: str = typer.Option("auto", "--algorithm", help="auto, ring or tree."),
    devices: int = typer.Option(8, "--devices", "-n", help="Ranks."),
) -> None:
    """Collective times with algorithm and bus bandwidth; with a model, the per-step
    communication of DDP, ZeRO-1/2/3, TP and PP."""
    from hpcml.plan.comm import OPS, collective_time, step_communication
    from hpcml.plan.memory import Layout

    cluster = opts.cluster(opts.load_catalog(), devices)
    s = parse_size(size)
    ops = [op] if op else list(OPS)
    rows = [collective_time(o, s, cluster, algorithm=algorithm) for o in ops]
    strategies: list[dict[str, Any]] = []
    mb, accum = opts.mb, opts.accum
    if opts.model or opts.params or opts.layers:
        shape = opts.shape()
        tr = opts.training()  # comm offers no --optimizer: adamw, its default
        options: list[tuple[str, Layout]] = [
            ("DDP", Layout(micro_batch=mb, grad_accum=accum)),
            ("ZeRO-1", Layout(zero=1, micro_batch=mb, grad_accum=accum)),
            ("ZeRO-2", Layout(zero=2, micro_batch=mb, grad_accum=accum)),
            ("ZeRO-3 / FSDP", Layout(zero=3, micro_batch=mb, grad_accum=accum)),
        ]
        if shape.is_transformer:
            tp = max(
                t
                for t in range(1, min(cluster.devices_per_node, devices) + 1)
                if devices % t == 0 and shape.heads % t == 0
            )
            if tp > 1:
                options.append((f"TP={tp} (+DP)", Layout(tp=tp, micro_batch=mb, grad_accum=accum)))
                options.append(
                    (f"TP={tp}+SP (+DP)", Layout(tp=tp, sp=True, micro_batch=mb, grad_accum=accum))
                )
            pp = max(p for p in (1, 2, 4, 8) if devices % p == 0 and p <= shape.layers)
            if pp > 1:
                options.append(
                    (f"PP={pp} (+DP)", Layout(pp=pp, micro_batch=mb, grad_accum=max(accum, pp)))
                )
        for name, lay in options:
            try:
                items = step_communication(shape, lay, tr, cluster)
            except PlanError as exc:
                strategies.append({"strategy": name, "error": exc.message})
                continue
            strategies.append(
                {
                    "strategy": name,
                    "collectives": [i.to_dict() for i in items],
                    "volume_bytes": sum(i.volume_bytes for i in items),
                    "time_s": sum(i.time_s for i in items),
                }
            )
    if opts.json_out:
        print_json(
            {
                "cluster": cluster.describe(),
                "collectives": [r.to_dict() for r in rows],
                "strategies": strategies,
            }
        )
        return
    t = Table(title=f"collectives of {human_bytes(s)} over {devices} ranks: {cluster.describe()}")
    for col in ("op", "algorithm", "time", "algbw GB/s", "busbw GB/s", "link GB/s"):
        t.add_column(col, justify="left" if col in ("op", "algorithm") else "right")
    for r in rows:
        t.add_row(
            r.op,
            r.algorithm,
            human_seconds(r.time_s),
            f"{r.algbw_bytes_per_s / 1e9:,.1f}",
            f"{r.busbw_bytes_per_s / 1e9:,.1f}",
            f"{r.link_bandwidth_bytes_per_s / 1e9:,.1f}",
        )
    console.print(t)
    if strategies:
        t = Table(title="communication per optimizer step (busiest device)")
        for col in ("strategy", "collectives", "volume / rank", "time (not overlapped)"):
            t.add_column(col)
        for st in strategies:
            if "error" in st:
                t.add_row(st["strategy"], st["error"], "-", "-")
                continue
            names = ", ".join(f"{c['name']} x{c['calls_per_step']:g}" for c in st["collectives"])
            t.add_row(
                st["strategy"],
                names or "none",
                human_bytes(st["volume_bytes"]),
                human_seconds(st["time_s"]),
            )
        console.print(t)


# --- step ------------------------------------------------------------------------------------
