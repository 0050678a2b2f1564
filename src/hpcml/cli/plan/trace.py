"""`hpcml plan memory --trace CONFIG [key=value ...]`: a run config's step traced on fake tensors
(`hpcml.train.memtrace`), with the formula path's prediction for the same config beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import _gb
from hpcml.cli.plan.shared import LAYOUT, MODEL, TRAINING, PlanOptions
from hpcml.plan.common import PlanError

# (row, where in the traced step, the formula's key): model states as the step leaves them,
# activations at the end of forward (what the formula counts), then what the peak holds.
_ROWS = (
    ("parameters", ("states", "params"), "params_bytes"),
    ("buffers", ("states", "buffers"), None),
    ("optimizer states", ("states", "optimizer"), "optimizer_bytes"),
    ("activations at the end of forward", ("activation_peak_bytes",), "activations_bytes"),
    ("at the peak: gradients", ("at_peak", "grads"), "grads_bytes"),
    ("at the peak: activations", ("at_peak", "activations"), None),
    ("at the peak: backward temporaries", ("at_peak", "temporaries"), None),
    ("at the peak: inputs", ("at_peak", "inputs"), None),
    ("at the peak: gathered parameters (FSDP)", ("at_peak", "gathered_params"), "buffers_bytes"),
    ("at the peak: all-gather buffers (FSDP)", ("at_peak", "all_gather"), None),
    ("at the peak: unsharded gradients (FSDP)", ("at_peak", "unsharded_grads"), None),
    ("at the peak: reduce-scatter buffers (FSDP)", ("at_peak", "reduce_scatter"), None),
)
_FSDP_ONLY = ("gathered_params", "all_gather", "unsharded_grads", "reduce_scatter")


def _refuse_shape_options(opts: PlanOptions) -> None:
    defaults = PlanOptions()
    given = [
        f"--{name.replace('_', '-')}"
        for name in (*MODEL, *LAYOUT, *TRAINING)
        if getattr(opts, name) != getattr(defaults, name)
    ]
    if given:
        raise PlanError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not used with --trace, "
            "which takes the model, layout and training from the config; set them there or as "
            "key=value overrides."
        )


def formula_for(cfg: Any, traced: dict[str, Any], catalog: Any, cluster: Any) -> Any:
    """The formula path's prediction for the same config: the shape the planner knows for
    the model (not the trace), the layout and training `plan check` reads from a run."""
    from hpcml.plan.check import setup_from_summary
    from hpcml.plan.memory import per_device_bytes

    summary = {
        "config": cfg.model_dump(mode="json"),
        "world_size": cluster.devices,
        "precision": cfg.precision,
        "device": {"type": "cpu", "name": "cpu"},
        "model": {
            "name": cfg.model.name,
            "args": traced["model_args"],
            "parameters": traced["parameters"],
            "input_shape": traced["input_shape"],
        },
    }
    setup = setup_from_summary(summary, catalog, label="--trace config")
    mem = per_device_bytes(
        setup.model, setup.layout, setup.training, cluster.devices, cluster.accelerator.memory_bytes
    )
    return mem, list(setup.notes)


def trace_cmd(
    opts: PlanOptions, path: Path, overrides: list[str], reserve: float, usable: float
) -> None:
    from hpcml.config import load_config
    from hpcml.plan.headroom import headroom_verdict
    from hpcml.train.memtrace import trace_config

    _refuse_shape_options(opts)
    cfg = load_config(path, overrides)
    catalog = opts.load_catalog()
    cluster = opts.cluster(catalog)
    traced = trace_config(cfg, opts.devices)
    mem, notes = formula_for(cfg, traced, catalog, cluster)
    cap = cluster.accelerator.memory_bytes
    budget = None if cap is None else usable * cap - reserve
    verdict, thin = headroom_verdict(traced["peak_bytes"], budget)
    drift = mem.total_bytes / traced["peak_bytes"] if traced["peak_bytes"] else None
    out = {
        **traced,
        "accelerator": cluster.accelerator.key,
        "device_memory_bytes": cap,
        "reserve_bytes": reserve,
        "usable_fraction": usable,
        "budget_bytes": budget,
        "headroom_bytes": None if budget is None else budget - traced["peak_bytes"],
        "fits": budget is None or traced["peak_bytes"] <= budget,
        "thin_headroom": thin,
        "formula": mem.to_dict(),
        "formula_over_traced": drift,
        "notes": notes,
    }
    if opts.json_out:
        print_json(out)
        return
    _print(out, mem, verdict, opts.devices, cluster)


def _print(out: dict[str, Any], mem: Any, verdict: str, devices: int, cluster: Any) -> None:
    from hpcml.cli.plan.memory import budget_line

    t = Table(
        title=f"{out['model']} ({out['parameters'] / 1e6:.1f}M params) per rank, traced: "
        f"{devices} x {cluster.accelerator.key}, {out['strategy']}, micro-batch "
        f"{out['micro_batch']} x {out['grad_accum']} of {'x'.join(map(str, out['input_shape']))}, "
        f"{out['precision']} {out['optimizer']}"
    )
    for col in ("part", "traced GB", "formula GB"):
        t.add_column(col, justify="left" if col == "part" else "right")
    formula = mem.to_dict()
    for label, where, formula_key in _ROWS:
        value: Any = out
        for key in where:
            value = value[key]
        if where[-1] in _FSDP_ONLY and not value:
            continue
        t.add_row(label, _gb(value), _gb(formula[formula_key]) if formula_key else "-")
    t.add_row("= peak", _gb(out["peak_bytes"]), _gb(mem.total_bytes))
    console.print(t)
    cap, usable, reserve = out["device_memory_bytes"], out["usable_fraction"], out["reserve_bytes"]
    console.print(budget_line(verdict, cap, usable, reserve))
    drift = out["formula_over_traced"]
    if drift is not None:
        console.print(f"formula path / traced peak: {drift:.2f}")
    for note in out["notes"]:
        console.print(f"note: {note}")
