"""`hpcml plan hardware` and `hpcml plan models`: what the planner knows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import (
    CATALOG_OPT,
    JSON_OPT,
    _catalog,
    _gb,
    app,
)


@app.command("hardware")
def hardware_cmd(catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT) -> None:
    """List the hardware catalog: accelerators, links and node shapes."""
    cat = _catalog(catalog)
    if json_out:
        print_json(
            {
                "accelerators": {
                    k: {
                        "display": a.display,
                        "memory_bytes": a.memory_bytes,
                        "memory_bandwidth_bytes_per_s": a.memory_bandwidth_bytes_per_s,
                        "peak_flops": dict(a.peak_flops),
                        "tdp_watts": a.tdp_watts,
                        "default_node": a.default_node,
                        "prices": [p.__dict__ for p in a.prices],
                        "purchase_usd_per_gpu": a.purchase_usd_per_gpu,
                    }
                    for k, a in cat.accelerators.items()
                },
                "links": {k: link.__dict__ for k, link in cat.links.items()},
                "nodes": {k: n.__dict__ for k, n in cat.nodes.items()},
                "sources": list(cat.sources),
            }
        )
        return
    t = Table(title="accelerators (dense peak)")
    for col in (
        "key",
        "memory GB",
        "HBM TB/s",
        "fp32 TF",
        "tf32 TF",
        "bf16 TF",
        "fp8 TF",
        "TDP W",
        "on-demand $/h (as of)",
    ):
        t.add_column(col, justify="left" if col == "key" else "right")
    for k, a in cat.accelerators.items():
        pk = a.peak_flops
        offer = a.price()
        t.add_row(
            k,
            _gb(a.memory_bytes),
            f"{a.memory_bandwidth_bytes_per_s / 1e12:.2f}",
            *[f"{pk[p] / 1e12:,.1f}" if p in pk else "-" for p in ("fp32", "tf32", "bf16", "fp8")],
            f"{a.tdp_watts:.0f}",
            f"{offer.usd_per_gpu_hour:.2f} ({offer.as_of})" if offer else "-",
        )
    console.print(t)
    t = Table(title="links (per direction, per device)")
    for col in ("key", "kind", "GB/s", "achievable", "latency us"):
        t.add_column(col)
    for k, link in cat.links.items():
        t.add_row(
            k,
            link.kind,
            f"{link.bandwidth_bytes_per_s / 1e9:,.1f}",
            f"{link.efficiency:.0%}",
            f"{link.latency_s * 1e6:.1f}",
        )
    console.print(t)
    t = Table(title="node shapes")
    for col in ("key", "accelerator", "per node", "inside", "between", "NICs"):
        t.add_column(col)
    for k, n in cat.nodes.items():
        t.add_row(
            k,
            n.accelerator,
            str(n.devices_per_node),
            n.intra_link,
            n.inter_link,
            str(n.nics_per_node),
        )
    console.print(t)


@app.command("models")
def models_cmd(json_out: bool = JSON_OPT) -> None:
    """List the model shapes the planner knows."""
    from hpcml.plan.shapes import known_models, model_shape

    rows: list[dict[str, Any]] = []
    for name in known_models():
        s = model_shape(name)
        rows.append(
            {
                "name": name,
                "params": s.params,
                "kind": s.kind,
                "layers": s.layers,
                "hidden": s.hidden,
                "heads": s.heads,
                "seq": s.seq,
                "vocab": s.vocab,
                "train_flops_per_sample": s.model_flops_per_sample(),
                "source": s.source,
            }
        )
    if json_out:
        print_json(rows)
        return
    t = Table(title="model shapes")
    for col in ("name", "params", "layers", "hidden", "heads", "seq", "vocab", "source"):
        t.add_column(col, justify="left" if col in ("name", "source") else "right")
    for r in rows:
        t.add_row(
            r["name"],
            f"{r['params']:,}",
            *[str(r[k] or "-") for k in ("layers", "hidden", "heads", "seq", "vocab")],
            r["source"],
        )
    console.print(t)


# --- memory ----------------------------------------------------------------------------------
