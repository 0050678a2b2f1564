"""`hpcml plan ...`: predict memory, communication, step time, layout and cost, and check the
predictions against measured runs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.plan.common import GB, PlanError, human_bytes, human_seconds

app = typer.Typer(
    help="Predict memory, communication, step time, the best layout and the cost of training.",
    no_args_is_help=True,
)
cost_app = typer.Typer(
    help="What training costs: a run per hardware option, cloud vs owned, spot vs on-demand.",
    no_args_is_help=True,
)
app.add_typer(cost_app, name="cost")

# --- shared options --------------------------------------------------------------------------

JSON_OPT = typer.Option(False, "--json", help="Machine-readable output.")
CATALOG_OPT = typer.Option(
    None, "--catalog", help="Extra hardware YAML (same layout as the shipped catalog)."
)
MODEL_OPT = typer.Option(None, "--model", "-m", help="Known model (`hpcml plan models`).")
ARGS_OPT = typer.Option("{}", "--args", help="Model builder arguments as JSON (zoo mlp).")
PARAMS_OPT = typer.Option(None, "--params", help="Parameter count, e.g. 7e9.")
LAYERS_OPT = typer.Option(None, "--layers", help="Transformer blocks.")
HIDDEN_OPT = typer.Option(None, "--hidden", help="Hidden size.")
HEADS_OPT = typer.Option(None, "--heads", help="Attention heads.")
SEQ_OPT = typer.Option(None, "--seq", help="Sequence length (tokens per sample).")
VOCAB_OPT = typer.Option(None, "--vocab", help="Vocabulary size.")
FFN_OPT = typer.Option(None, "--ffn-hidden", help="MLP inner size (default 4 x hidden).")
FLOPS_OPT = typer.Option(
    None, "--flops-per-sample", help="Forward FLOPs per sample for a non-transformer."
)
DEVICES_OPT = typer.Option(1, "--devices", "-n", help="Number of accelerators.")
GPU_OPT = typer.Option(None, "--gpu", help="Accelerator (`hpcml plan hardware`), e.g. h100-sxm.")
NODE_OPT = typer.Option(None, "--node", help="Node shape, e.g. hgx-h100 (sets GPU and links).")
PER_NODE_OPT = typer.Option(None, "--gpus-per-node", help="Devices per node.")
INTRA_OPT = typer.Option(None, "--intra", help="Intra-node link, e.g. nvlink4.")
INTER_OPT = typer.Option(None, "--inter", help="Inter-node link, e.g. ib-ndr.")
NICS_OPT = typer.Option(None, "--nics-per-node", help="Network adapters per node.")
TP_OPT = typer.Option(1, "--tp", help="Tensor-parallel degree.")
PP_OPT = typer.Option(1, "--pp", help="Pipeline-parallel degree.")
ZERO_OPT = typer.Option(0, "--zero", help="ZeRO stage 0-3 (3 = FSDP full sharding).")
SP_OPT = typer.Option(None, "--sp/--no-sp", help="Sequence parallelism (default: on when tp>1).")
SCHEDULE_OPT = typer.Option("1f1b", "--schedule", help="Pipeline schedule: 1f1b or interleaved.")
VIRTUAL_OPT = typer.Option(2, "--virtual-stages", help="Chunks per stage (interleaved only).")
MB_OPT = typer.Option(1, "--micro-batch", help="Samples per micro-batch per replica.")
ACCUM_OPT = typer.Option(1, "--grad-accum", help="Micro-batches per step (pipeline's m).")
RECOMPUTE_OPT = typer.Option("none", "--recompute", help="none, selective or full.")
OFFLOAD_OPT = typer.Option("none", "--offload", help="none, optimizer or params (CPU offload).")
OPTIM_OPT = typer.Option("adamw", "--optimizer", help="adamw, sgd, sgd-nomomentum, adam8bit.")
PRECISION_OPT = typer.Option("bf16", "--precision", help="fp32, tf32, bf16, fp16, fp8.")
WEIGHTS_OPT = typer.Option(
    None, "--weights",
    help="mixed (half weights + fp32 master), amp (fp32 weights, autocast) or pure.",
)
EFF_OPT = typer.Option(None, "--efficiency", help="Share of peak FLOP/s reached (calibrated).")
OVERHEAD_OPT = typer.Option(0.0, "--overhead-s", help="Fixed seconds per step (calibrated).")
OVERLAP_OPT = typer.Option(1.0, "--overlap", help="Share of the overlap window comm hides in.")


def _catalog(paths: list[Path] | None) -> Any:
    from hpcml.plan.hardware import load_catalog

    return load_catalog(paths or [])


def _model(model: str | None, args: str, params: float | None, layers: int | None,
           hidden: int | None, heads: int | None, seq: int | None, vocab: int | None,
           ffn: int | None, flops: float | None) -> Any:
    from hpcml.plan.shapes import model_shape, shape_from_raw

    if model:
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            raise PlanError(
                f"--args {args!r} is not valid JSON; pass an object like '{{\"hidden\": 512}}'."
            ) from None
        return model_shape(model, parsed, seq=seq)
    return shape_from_raw(
        params=int(params) if params else None, layers=layers, hidden=hidden, heads=heads,
        seq=seq, vocab=vocab, ffn_hidden=ffn, flops_per_sample=flops,
    )


def _cluster(catalog: Any, devices: int, gpu: str | None, node: str | None,
             per_node: int | None, intra: str | None, inter: str | None,
             nics: int | None) -> Any:
    from hpcml.plan.hardware import resolve_cluster

    return resolve_cluster(catalog, devices, accelerator=gpu, node=node,
                           devices_per_node=per_node, intra=intra, inter=inter,
                           nics_per_node=nics)


def _layout(tp: int, pp: int, zero: int, sp: bool | None, schedule: str, virtual: int,
            mb: int, accum: int, recompute: str, offload: str) -> Any:
    from hpcml.plan.memory import Layout

    return Layout(tp=tp, pp=pp, zero=zero, sp=(tp > 1) if sp is None else sp,
                  schedule=schedule, virtual_stages=virtual if schedule == "interleaved" else 1,
                  micro_batch=mb, grad_accum=accum, recompute=recompute, offload=offload)


def _training(precision: str, optimizer: str, weights: str | None) -> Any:
    from hpcml.plan.memory import Training

    return Training(precision=precision, optimizer=optimizer, weights=weights)


def _calibration(cluster: Any, efficiency: float | None, overhead: float) -> Any:
    from hpcml.plan.perf import Calibration

    if efficiency is None:
        return Calibration(cluster.accelerator.default_efficiency, overhead)
    if not 0 < efficiency <= 1.5:
        raise PlanError(f"--efficiency {efficiency} must lie in (0, 1.5].")
    return Calibration(efficiency, overhead, "--efficiency")


_SIZE_RE = re.compile(r"^\s*([0-9.eE+-]+)\s*([kKmMgGtT]?i?[bB]?)\s*$")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> float:
    """'1GB' -> 1e9, '256MiB' -> 268435456, '4096' -> 4096."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise PlanError(f"size '{text}' is not understood; write e.g. 4096, 256MB, 1GiB.")
    try:
        return float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise PlanError(f"size '{text}' is not understood; write e.g. 4096, 256MB, 1GiB.") from None


def _short(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:,.2f}"


# --- hardware and models ---------------------------------------------------------------------


@app.command("hardware")
def hardware_cmd(catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT) -> None:
    """List the hardware catalog: accelerators, links and node shapes."""
    cat = _catalog(catalog)
    if json_out:
        print_json({
            "accelerators": {k: {"display": a.display, "memory_bytes": a.memory_bytes,
                                 "memory_bandwidth_bytes_per_s": a.memory_bandwidth_bytes_per_s,
                                 "peak_flops": dict(a.peak_flops), "tdp_watts": a.tdp_watts,
                                 "default_node": a.default_node,
                                 "prices": [p.__dict__ for p in a.prices],
                                 "purchase_usd_per_gpu": a.purchase_usd_per_gpu}
                             for k, a in cat.accelerators.items()},
            "links": {k: link.__dict__ for k, link in cat.links.items()},
            "nodes": {k: n.__dict__ for k, n in cat.nodes.items()},
            "sources": list(cat.sources),
        })
        return
    t = Table(title="accelerators (dense peak)")
    for col in ("key", "memory GB", "HBM TB/s", "fp32 TF", "tf32 TF", "bf16 TF", "fp8 TF",
                "TDP W", "on-demand $/h (as of)"):
        t.add_column(col, justify="left" if col == "key" else "right")
    for k, a in cat.accelerators.items():
        pk = a.peak_flops
        offer = a.price()
        t.add_row(k, _gb(a.memory_bytes), f"{a.memory_bandwidth_bytes_per_s / 1e12:.2f}",
                  *[f"{pk[p] / 1e12:,.1f}" if p in pk else "-" for p in ("fp32", "tf32", "bf16",
                                                                         "fp8")],
                  f"{a.tdp_watts:.0f}",
                  f"{offer.usd_per_gpu_hour:.2f} ({offer.as_of})" if offer else "-")
    console.print(t)
    t = Table(title="links (per direction, per device)")
    for col in ("key", "kind", "GB/s", "achievable", "latency us"):
        t.add_column(col)
    for k, link in cat.links.items():
        t.add_row(k, link.kind, f"{link.bandwidth_bytes_per_s / 1e9:,.1f}", f"{link.efficiency:.0%}",
                  f"{link.latency_s * 1e6:.1f}")
    console.print(t)
    t = Table(title="node shapes")
    for col in ("key", "accelerator", "per node", "inside", "between", "NICs"):
        t.add_column(col)
    for k, n in cat.nodes.items():
        t.add_row(k, n.accelerator, str(n.devices_per_node), n.intra_link, n.inter_link,
                  str(n.nics_per_node))
    console.print(t)


@app.command("models")
def models_cmd(json_out: bool = JSON_OPT) -> None:
    """List the model shapes the planner knows."""
    from hpcml.plan.shapes import known_models, model_shape

    rows: list[dict[str, Any]] = []
    for name in known_models():
        s = model_shape(name)
        rows.append({"name": name, "params": s.params, "kind": s.kind, "layers": s.layers,
                     "hidden": s.hidden, "heads": s.heads, "seq": s.seq, "vocab": s.vocab,
                     "train_flops_per_sample": s.model_flops_per_sample(), "source": s.source})
    if json_out:
        print_json(rows)
        return
    t = Table(title="model shapes")
    for col in ("name", "params", "layers", "hidden", "heads", "seq", "vocab", "source"):
        t.add_column(col, justify="left" if col in ("name", "source") else "right")
    for r in rows:
        t.add_row(r["name"], f"{r['params']:,}", *[str(r[k] or "-") for k in
                                                  ("layers", "hidden", "heads", "seq", "vocab")],
                  r["source"])
    console.print(t)


# --- memory ----------------------------------------------------------------------------------


@app.command("memory")
def memory_cmd(
    model: str | None = MODEL_OPT, args: str = ARGS_OPT, params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT, hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT, seq: int | None = SEQ_OPT, vocab: int | None = VOCAB_OPT,
    ffn: int | None = FFN_OPT, flops: float | None = FLOPS_OPT,
    devices: int = DEVICES_OPT, gpu: str | None = GPU_OPT, node: str | None = NODE_OPT,
    tp: int = TP_OPT, pp: int = PP_OPT, zero: int = ZERO_OPT, sp: bool | None = SP_OPT,
    schedule: str = SCHEDULE_OPT, virtual: int = VIRTUAL_OPT, mb: int = MB_OPT,
    accum: int = ACCUM_OPT, recompute: str = RECOMPUTE_OPT, offload: str = OFFLOAD_OPT,
    optimizer: str = OPTIM_OPT, precision: str = PRECISION_OPT, weights: str | None = WEIGHTS_OPT,
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Per-device bytes of parameters, gradients, optimizer states and activations."""
    from hpcml.plan.memory import per_device_bytes

    cat = _catalog(catalog)
    shape = _model(model, args, params, layers, hidden, heads, seq, vocab, ffn, flops)
    cluster = _cluster(cat, devices, gpu, node, None, None, None, None)
    lay = _layout(tp, pp, zero, sp, schedule, virtual, mb, accum, recompute, offload)
    tr = _training(precision, optimizer, weights)
    mem = per_device_bytes(shape, lay, tr, devices, cluster.accelerator.memory_bytes)
    dp = lay.dp(devices)
    out = {"model": shape.name, "parameters": shape.params, "devices": devices, "dp": dp,
           "tp": tp, "pp": pp, "zero": zero, "sp": lay.sp, "micro_batch": mb,
           "grad_accum": accum, "recompute": recompute, "offload": offload,
           "precision": tr.precision, "weights": tr.weight_mode, "optimizer": tr.optimizer,
           "accelerator": cluster.accelerator.key, "fits": mem.fits(), **mem.to_dict()}
    if json_out:
        print_json(out)
        return
    size = (f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9
            else f"{shape.params / 1e6:.1f}M")
    t = Table(title=f"{shape.name} ({size} params) per device: {devices} x "
              f"{cluster.accelerator.key}, dp={dp} tp={tp} pp={pp} ZeRO-{zero}, "
              f"{tr.precision}/{tr.weight_mode} {tr.optimizer}")
    t.add_column("part")
    t.add_column("GB", justify="right")
    for label, key in (("parameters", "params_bytes"), ("gradients", "grads_bytes"),
                       ("optimizer states", "optimizer_bytes"),
                       ("= model states", "model_states_bytes"),
                       ("activations", "activations_bytes"),
                       ("communication buffers", "buffers_bytes"),
                       ("optimizer temporaries", "optimizer_temp_bytes"),
                       ("= peak total", "total_bytes"), ("offloaded to host", "host_bytes")):
        t.add_row(label, _gb(out[key]))
    cap = cluster.accelerator.memory_bytes
    t.add_row("device memory", _gb(cap))
    console.print(t)
    verdict = "fits" if mem.fits() else "does NOT fit"
    console.print(f"{verdict} in 90% of {human_bytes(cap)}" if cap else "host memory: not checked")
    for note in mem.notes:
        console.print(f"note: {note}")


# --- comm ------------------------------------------------------------------------------------


@app.command("comm")
def comm_cmd(
    size: str = typer.Option("256MB", "--size", help="Message size S (nccl-tests' size)."),
    op: str | None = typer.Option(None, "--op", help="One collective (default: all)."),
    algorithm: str = typer.Option("auto", "--algorithm", help="auto, ring or tree."),
    devices: int = typer.Option(8, "--devices", "-n", help="Ranks."),
    gpu: str | None = GPU_OPT, node: str | None = NODE_OPT, per_node: int | None = PER_NODE_OPT,
    intra: str | None = INTRA_OPT, inter: str | None = INTER_OPT, nics: int | None = NICS_OPT,
    model: str | None = MODEL_OPT, args: str = ARGS_OPT, params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT, hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT, seq: int | None = SEQ_OPT, vocab: int | None = VOCAB_OPT,
    mb: int = MB_OPT, accum: int = ACCUM_OPT, precision: str = PRECISION_OPT,
    weights: str | None = WEIGHTS_OPT, catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Collective times with algorithm and bus bandwidth; with a model, the per-step
    communication of DDP, ZeRO-1/2/3, TP and PP."""
    from hpcml.plan.comm import OPS, collective_time, step_communication
    from hpcml.plan.memory import Layout

    cat = _catalog(catalog)
    cluster = _cluster(cat, devices, gpu, node, per_node, intra, inter, nics)
    s = parse_size(size)
    ops = [op] if op else list(OPS)
    rows = [collective_time(o, s, cluster, algorithm=algorithm) for o in ops]
    strategies: list[dict[str, Any]] = []
    if model or params or layers:
        shape = _model(model, args, params, layers, hidden, heads, seq, vocab, None, None)
        tr = _training(precision, "adamw", weights)
        options: list[tuple[str, Layout]] = [
            ("DDP", Layout(micro_batch=mb, grad_accum=accum)),
            ("ZeRO-1", Layout(zero=1, micro_batch=mb, grad_accum=accum)),
            ("ZeRO-2", Layout(zero=2, micro_batch=mb, grad_accum=accum)),
            ("ZeRO-3 / FSDP", Layout(zero=3, micro_batch=mb, grad_accum=accum)),
        ]
        if shape.is_transformer:
            tp = max(t for t in range(1, min(cluster.devices_per_node, devices) + 1)
                     if devices % t == 0 and shape.heads % t == 0)
            if tp > 1:
                options.append((f"TP={tp} (+DP)", Layout(tp=tp, micro_batch=mb, grad_accum=accum)))
                options.append((f"TP={tp}+SP (+DP)",
                                Layout(tp=tp, sp=True, micro_batch=mb, grad_accum=accum)))
            pp = max(p for p in (1, 2, 4, 8) if devices % p == 0 and p <= shape.layers)
            if pp > 1:
                options.append((f"PP={pp} (+DP)", Layout(pp=pp, micro_batch=mb,
                                                         grad_accum=max(accum, pp))))
        for name, lay in options:
            try:
                items = step_communication(shape, lay, tr, cluster)
            except PlanError as exc:
                strategies.append({"strategy": name, "error": exc.message})
                continue
            strategies.append({
                "strategy": name,
                "collectives": [i.to_dict() for i in items],
                "volume_bytes": sum(i.volume_bytes for i in items),
                "time_s": sum(i.time_s for i in items),
            })
    if json_out:
        print_json({"cluster": cluster.describe(), "collectives": [r.to_dict() for r in rows],
                    "strategies": strategies})
        return
    t = Table(title=f"collectives of {human_bytes(s)} over {devices} ranks: {cluster.describe()}")
    for col in ("op", "algorithm", "time", "algbw GB/s", "busbw GB/s", "link GB/s"):
        t.add_column(col, justify="left" if col in ("op", "algorithm") else "right")
    for r in rows:
        t.add_row(r.op, r.algorithm, human_seconds(r.time_s),
                  f"{r.algbw_bytes_per_s / 1e9:,.1f}", f"{r.busbw_bytes_per_s / 1e9:,.1f}",
                  f"{r.link_bandwidth_bytes_per_s / 1e9:,.1f}")
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
            t.add_row(st["strategy"], names or "none", human_bytes(st["volume_bytes"]),
                      human_seconds(st["time_s"]))
        console.print(t)


# --- step ------------------------------------------------------------------------------------


def _default_counts(devices: int, per_node: int) -> list[int]:
    counts, n = [], 1
    while n < devices:
        counts.append(n)
        n *= 2
    counts.append(devices)
    return sorted(set(counts))


@app.command("step")
def step_cmd(
    model: str | None = MODEL_OPT, args: str = ARGS_OPT, params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT, hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT, seq: int | None = SEQ_OPT, vocab: int | None = VOCAB_OPT,
    ffn: int | None = FFN_OPT, flops: float | None = FLOPS_OPT,
    devices: int = DEVICES_OPT, gpu: str | None = GPU_OPT, node: str | None = NODE_OPT,
    per_node: int | None = PER_NODE_OPT, intra: str | None = INTRA_OPT,
    inter: str | None = INTER_OPT, nics: int | None = NICS_OPT,
    tp: int = TP_OPT, pp: int = PP_OPT, zero: int = ZERO_OPT, sp: bool | None = SP_OPT,
    schedule: str = SCHEDULE_OPT, virtual: int = VIRTUAL_OPT, mb: int = MB_OPT,
    accum: int = ACCUM_OPT, recompute: str = RECOMPUTE_OPT, offload: str = OFFLOAD_OPT,
    optimizer: str = OPTIM_OPT, precision: str = PRECISION_OPT, weights: str | None = WEIGHTS_OPT,
    efficiency: float | None = EFF_OPT, overhead: float = OVERHEAD_OPT,
    overlap: float = OVERLAP_OPT,
    scaling: str | None = typer.Option(
        None, "--scaling", help="Device counts for the scaling curve, e.g. 8,16,32,64."
    ),
    global_batch: int | None = typer.Option(
        None, "--global-batch", help="Fix samples per step (strong scaling) in the curve."
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write the scaling curve as PNG."),
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Predicted step time, throughput and MFU, and a scaling curve over device counts."""
    from hpcml.plan.perf import scaling_curve, step_time

    cat = _catalog(catalog)
    shape = _model(model, args, params, layers, hidden, heads, seq, vocab, ffn, flops)
    cluster = _cluster(cat, devices, gpu, node, per_node, intra, inter, nics)
    lay = _layout(tp, pp, zero, sp, schedule, virtual, mb, accum, recompute, offload)
    tr = _training(precision, optimizer, weights)
    cal = _calibration(cluster, efficiency, overhead)
    est = step_time(shape, lay, tr, cluster, cal, overlap)
    try:
        counts = ([int(x) for x in scaling.split(",") if x.strip()] if scaling
                  else _default_counts(devices, cluster.devices_per_node))
    except ValueError:
        raise PlanError(f"--scaling '{scaling}' must be comma-separated integers.") from None
    curve = scaling_curve(shape, lay, tr, cluster, counts, global_batch, cal, overlap)
    base = curve[0]
    rows = [{"devices": e.devices, "step_s": e.step_s, "samples_per_s": e.samples_per_s,
             "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
             "speedup": e.samples_per_s / base.samples_per_s,
             "scaling_efficiency": (e.samples_per_s / base.samples_per_s)
             / (e.devices / base.devices)} for e in curve]
    if plot:
        _plot_scaling(rows, plot, f"{shape.name} on {cluster.accelerator.key}")
    if json_out:
        print_json({"model": shape.name, "cluster": cluster.describe(),
                    "calibration": cal.to_dict(), "step": est.to_dict(), "scaling": rows,
                    "plot": str(plot) if plot else None})
        return
    t = Table(title=f"{shape.name} step on {cluster.describe()}: dp={est.dp} tp={tp} pp={pp} "
              f"ZeRO-{zero}, micro-batch {mb} x {accum}, recompute {recompute}")
    t.add_column("term")
    t.add_column("seconds", justify="right")
    for label, value in (("compute (at efficiency %.0f%%)" % (cal.efficiency * 100),
                          est.compute_s),
                         ("communication on the critical path", est.critical_comm_s),
                         ("pipeline bubble", est.bubble_s),
                         ("data-parallel comm (total)", est.dp_comm_s),
                         ("data-parallel comm (exposed)", est.exposed_dp_comm_s),
                         ("optimizer step", est.optimizer_s), ("fixed overhead", est.overhead_s),
                         ("= step", est.step_s)):
        t.add_row(label, f"{value:.4f}")
    console.print(t)
    rate = (f"{est.tokens_per_s:,.0f} tokens/s" if shape.is_transformer
            else f"{est.samples_per_s:,.1f} samples/s")
    console.print(f"{rate}, MFU {est.mfu:.1%} (HFU {est.hfu:.1%})")
    t = Table(title="scaling" + (" (fixed global batch)" if global_batch else
                                 " (fixed per-device batch)"))
    for col in ("devices", "step s", "samples/s", "tokens/s", "MFU", "speedup", "efficiency"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["devices"]), f"{r['step_s']:.4f}", f"{r['samples_per_s']:,.1f}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}", f"{r['speedup']:.2f}",
                  f"{r['scaling_efficiency']:.0%}")
    console.print(t)
    if plot:
        console.print(f"plot written to {plot}")


def _plot_scaling(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["devices"] for r in rows]
    ax.plot(n, [r["speedup"] for r in rows], "o-", label="predicted")
    ax.plot(n, [x / n[0] for x in n], "--", color="grey", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("throughput speedup")
    _finish_plot(fig, ax, title, path)



def _finish_plot(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Title, legend and a PNG at `path`; shared by the scaling and TCO plots."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

# --- advise ----------------------------------------------------------------------------------


@app.command("advise")
def advise_cmd(
    model: str | None = MODEL_OPT, args: str = ARGS_OPT, params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT, hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT, seq: int | None = SEQ_OPT, vocab: int | None = VOCAB_OPT,
    ffn: int | None = FFN_OPT, flops: float | None = FLOPS_OPT,
    devices: int = DEVICES_OPT, gpu: str | None = GPU_OPT, node: str | None = NODE_OPT,
    per_node: int | None = PER_NODE_OPT, intra: str | None = INTRA_OPT,
    inter: str | None = INTER_OPT, nics: int | None = NICS_OPT,
    global_batch: int = typer.Option(..., "--global-batch", help="Samples (sequences) per step."),
    optimizer: str = OPTIM_OPT, precision: str = PRECISION_OPT, weights: str | None = WEIGHTS_OPT,
    efficiency: float | None = EFF_OPT, overhead: float = OVERHEAD_OPT,
    overlap: float = OVERLAP_OPT,
    top: int = typer.Option(5, "--top", help="How many layouts to show."),
    usable: float = typer.Option(0.9, "--usable", help="Share of device memory a plan may use."),
    allow_offload: bool = typer.Option(False, "--allow-offload", help="Also try CPU offload."),
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Search data/tensor/pipeline degrees, ZeRO, micro-batch and recomputation; rank by speed."""
    from hpcml.plan.advise import advise

    cat = _catalog(catalog)
    shape = _model(model, args, params, layers, hidden, heads, seq, vocab, ffn, flops)
    cluster = _cluster(cat, devices, gpu, node, per_node, intra, inter, nics)
    tr = _training(precision, optimizer, weights)
    cal = _calibration(cluster, efficiency, overhead)
    result = advise(shape, tr, cluster, global_batch, top=top, usable_fraction=usable,
                    calibration=cal, overlap=overlap,
                    offload=("none", "optimizer", "params") if allow_offload else ("none",))
    if json_out:
        print_json({
            "model": shape.name, "cluster": cluster.describe(), "global_batch": global_batch,
            "considered": result.considered, "rejected_memory": result.rejected_memory,
            "usable_bytes": result.usable_bytes, "why": result.why,
            "candidates": [{"label": c.label(), "memory": c.memory.to_dict(),
                            "step": c.estimate.to_dict()} for c in result.candidates],
        })
        return
    t = Table(title=f"best layouts for {shape.name}, global batch {global_batch}, on "
              f"{cluster.describe()}: {result.considered} tried, {result.rejected_memory} "
              "did not fit")
    for col in ("#", "dp", "tp", "pp", "ZeRO", "mb x m", "recompute", "GB", "step s", "comm s",
                "tok/s" if shape.is_transformer else "smp/s", "MFU"):
        t.add_column(col, justify="right")
    for i, c in enumerate(result.candidates, 1):
        e, lay = c.estimate, c.layout
        t.add_row(str(i), str(e.dp), f"{lay.tp}{'+sp' if lay.sp else ''}",
                  f"{lay.pp}{'x' + str(lay.virtual_stages) if lay.schedule == 'interleaved' else ''}",
                  str(lay.zero), f"{lay.micro_batch}x{lay.grad_accum}", lay.recompute[:3],
                  f"{c.memory.total_bytes / GB:.1f}", f"{e.step_s:.3g}",
                  f"{e.exposed_comm_s:.2g}",
                  _short(e.tokens_per_s if shape.is_transformer else e.samples_per_s),
                  f"{e.mfu:.0%}")
    console.print(t)
    console.print(result.why)


# --- cost ------------------------------------------------------------------------------------


@cost_app.command("run")
def cost_run_cmd(
    model: str | None = MODEL_OPT, args: str = ARGS_OPT, params: float | None = PARAMS_OPT,
    layers: int | None = LAYERS_OPT, hidden: int | None = HIDDEN_OPT,
    heads: int | None = HEADS_OPT, seq: int | None = SEQ_OPT, vocab: int | None = VOCAB_OPT,
    flops: float | None = FLOPS_OPT,
    tokens: float | None = typer.Option(None, "--tokens", help="Training tokens, e.g. 2e12."),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps (with --global-batch)."),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Samples per step."),
    gpus: list[str] = typer.Option(None, "--gpu", help="Hardware options (repeat; default all GPUs)."),
    devices: int = DEVICES_OPT, precision: str = PRECISION_OPT,
    mfu: float | None = typer.Option(None, "--mfu", help="Model FLOPs utilisation (default per GPU)."),
    price: float | None = typer.Option(None, "--price", help="USD per GPU-hour for every option."),
    provider: str | None = typer.Option(None, "--provider", help="Catalog price from this provider."),
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Tokens or steps -> GPU-hours -> money, per hardware option."""
    from hpcml.plan.cost import run_cost

    cat = _catalog(catalog)
    shape = _model(model, args, params, layers, hidden, heads, seq, vocab, None, flops)
    samples = None
    if tokens is None:
        if steps is None or global_batch is None:
            raise PlanError("give the run's length with --tokens, or --steps and --global-batch.")
        samples = float(steps) * global_batch
    keys = gpus or [k for k in cat.accelerators if k != "cpu"]
    accs = [cat.accelerator(k) for k in keys]
    usable = [a for a in accs if _has_precision(a, precision)]
    if not usable:
        raise PlanError(f"none of {', '.join(keys)} lists a peak for {precision}; pick another "
                        "--precision.")
    rows = run_cost(shape, usable, precision, devices, tokens=tokens, samples=samples, mfu=mfu,
                    price_usd_per_gpu_hour=price, provider=provider)
    rows.sort(key=lambda r: (r.cost_usd is None, r.cost_usd or 0.0))
    if json_out:
        print_json({"model": shape.name, "tokens": tokens, "samples": samples,
                    "options": [r.to_dict() for r in rows]})
        return
    what = f"{tokens:.3g} tokens" if tokens else f"{steps} steps x {global_batch} samples"
    t = Table(title=f"cost of training {shape.name} on {what} with {devices} devices "
              f"({rows[0].total_flops:.3g} FLOPs, {precision})")
    for col in ("hardware", "MFU", "GPU-hours", "wall time", "$/GPU-h", "cost", "energy MWh"):
        t.add_column(col, justify="left" if col == "hardware" else "right")
    for r in rows:
        t.add_row(r.accelerator, f"{r.mfu:.0%}", f"{r.gpu_hours:,.0f}",
                  human_seconds(r.wall_hours * 3600),
                  f"{r.usd_per_gpu_hour:.2f}" if r.usd_per_gpu_hour is not None else "-",
                  f"${r.cost_usd:,.0f}" if r.cost_usd is not None else "-",
                  f"{r.energy_kwh / 1000:,.1f}")
    console.print(t)
    for r in rows:
        if r.usd_per_gpu_hour is not None:
            console.print(f"{r.accelerator}: ${r.usd_per_gpu_hour:.2f}/GPU-h from "
                          f"{r.price_provider}" + (f" (as of {r.price_as_of})"
                                                   if r.price_as_of else ""))


def _has_precision(acc: Any, precision: str) -> bool:
    try:
        acc.peak(precision)
    except PlanError:
        return False
    return True


@cost_app.command("tco")
def cost_tco_cmd(
    gpu: str = typer.Option("h100-sxm", "--gpu", help="Accelerator to own or rent."),
    devices: int = typer.Option(64, "--devices", "-n", help="Devices."),
    purchase: float | None = typer.Option(None, "--purchase", help="USD per device incl. server."),
    cloud_price: float | None = typer.Option(None, "--cloud-price", help="USD per device-hour."),
    provider: str | None = typer.Option(None, "--provider", help="Catalog price from this provider."),
    utilization: float = typer.Option(0.7, "--utilization", help="Busy share of owned hours."),
    pue: float = typer.Option(1.3, "--pue", help="Power usage effectiveness of the facility."),
    kwh: float = typer.Option(0.10, "--kwh-price", help="USD per kWh."),
    ops: float = typer.Option(0.10, "--ops", help="Operations per year, share of purchase."),
    idle_power: float = typer.Option(0.3, "--idle-power", help="Idle draw / busy draw."),
    amortization: int = typer.Option(48, "--amortization-months", help="Depreciation period."),
    horizon: int = typer.Option(60, "--horizon-months", help="Months to compare."),
    plot: Path | None = typer.Option(None, "--plot", help="Write cumulative costs as PNG."),
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Cloud vs owned: purchase, amortization, power x PUE, operations, utilization."""
    from hpcml.plan.cost import TcoInputs, tco

    cat = _catalog(catalog)
    acc = cat.accelerator(gpu)
    offer = acc.price(provider)
    cp = cloud_price if cloud_price is not None else (offer.usd_per_gpu_hour if offer else None)
    pp = purchase if purchase is not None else acc.purchase_usd_per_gpu
    if cp is None or pp is None:
        raise PlanError(f"the catalog has no cloud or purchase price for {acc.key}; pass "
                        "--cloud-price and --purchase.")
    host_w = 0.0
    if acc.default_node and acc.default_node in cat.nodes:
        node = cat.nodes[acc.default_node]
        host_w = node.host_watts / node.devices_per_node
    inputs = TcoInputs(devices=devices, purchase_usd_per_device=pp, cloud_usd_per_device_hour=cp,
                       device_watts=acc.tdp_watts, host_watts_per_device=host_w,
                       utilization=utilization, idle_power_fraction=idle_power, pue=pue,
                       usd_per_kwh=kwh, ops_fraction_per_year=ops,
                       amortization_months=amortization, horizon_months=horizon)
    res = tco(inputs)
    if plot:
        _plot_tco(res, plot, f"{devices} x {acc.key}: owned vs cloud")
    if json_out:
        d = res.to_dict()
        d["accelerator"] = acc.key
        d["cloud_price_source"] = (f"{offer.provider} ({offer.as_of})" if offer and cloud_price
                                   is None else "--cloud-price")
        d["plot"] = str(plot) if plot else None
        print_json(d)
        return
    t = Table(title=f"{devices} x {acc.key}: owned vs cloud at {utilization:.0%} utilization")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("purchase", f"${devices * pp:,.0f}")
    t.add_row("owned: power per month (x PUE)", f"${res.power_usd_per_month:,.0f}")
    t.add_row("owned: power + operations per month", f"${res.onprem_monthly_opex_usd:,.0f}")
    t.add_row("cloud: per month for the same useful hours", f"${res.cloud_monthly_usd:,.0f}")
    t.add_row(f"owned: $ per useful device-hour ({amortization} months)",
              f"{res.onprem_usd_per_useful_device_hour:.2f}")
    t.add_row("cloud: $ per useful device-hour", f"{res.cloud_usd_per_useful_device_hour:.2f}")
    t.add_row("break-even month", f"{res.break_even_month:.1f}" if res.break_even_month
              else "never (cloud cheaper)")
    t.add_row(f"owned total at {horizon} months", f"${res.onprem_cumulative_usd[-1]:,.0f}")
    t.add_row(f"cloud total at {horizon} months", f"${res.cloud_cumulative_usd[-1]:,.0f}")
    console.print(t)
    for note in res.notes:
        console.print(f"note: {note}")
    if plot:
        console.print(f"plot written to {plot}")


def _plot_tco(res: Any, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    months = list(range(len(res.onprem_cumulative_usd)))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(months, [x / 1e6 for x in res.onprem_cumulative_usd], label="owned")
    ax.plot(months, [x / 1e6 for x in res.cloud_cumulative_usd], label="cloud")
    if res.break_even_month and res.break_even_month <= months[-1]:
        ax.axvline(res.break_even_month, color="grey", linestyle="--",
                   label=f"break-even {res.break_even_month:.1f} mo")
    ax.set_xlabel("month")
    ax.set_ylabel("cumulative cost (M USD)")
    _finish_plot(fig, ax, title, path)


@cost_app.command("spot")
def cost_spot_cmd(
    gpu: str = typer.Option("h100-sxm", "--gpu", help="Accelerator (for its on-demand price)."),
    on_demand: float | None = typer.Option(None, "--on-demand-price", help="USD per device-hour."),
    provider: str | None = typer.Option(None, "--provider", help="Catalog price from this provider."),
    discount: float = typer.Option(0.6, "--discount", help="Spot discount, e.g. 0.6 = 60% off."),
    preemptions: float = typer.Option(
        0.05, "--preemptions-per-hour", help="Preemptions per instance-hour."
    ),
    instances: int = typer.Option(8, "--instances", help="Instances (nodes) the job needs."),
    checkpoint_s: float = typer.Option(60.0, "--checkpoint-s", help="Seconds to write one."),
    restart_s: float = typer.Option(600.0, "--restart-s", help="Seconds to get back to work."),
    od_failures: float = typer.Option(
        0.0, "--on-demand-failures-per-hour", help="Failures per on-demand instance-hour."
    ),
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Spot economics: Young/Daly checkpoint interval, expected goodput, effective price."""
    from hpcml.plan.cost import spot_economics

    price = on_demand
    source = "--on-demand-price"
    if price is None:
        acc = _catalog(catalog).accelerator(gpu)
        offer = acc.price(provider)
        if offer is None:
            raise PlanError(f"the catalog has no on-demand price for {acc.key}; pass "
                            "--on-demand-price.")
        price, source = offer.usd_per_gpu_hour, f"{offer.provider} ({offer.as_of})"
    res = spot_economics(price, discount, preemptions, instances, checkpoint_s, restart_s,
                         od_failures)
    if json_out:
        d = res.to_dict()
        d["price_source"] = source
        print_json({k: (None if isinstance(v, float) and math.isinf(v) else v)
                    for k, v in d.items()})
        return
    t = Table(title=f"spot vs on-demand for a job on {instances} instances "
              f"(on-demand ${price:.2f}/device-h, {source})")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("spot price, $/device-h", f"{res.spot_usd_per_hour:.2f}")
    t.add_row("job interruptions per hour", f"{res.interruptions_per_hour:.3f}")
    t.add_row("mean time between interruptions", human_seconds(res.mtbf_s))
    t.add_row("checkpoint interval, Young 1974", human_seconds(res.young_interval_s))
    t.add_row("checkpoint interval, Daly 2006", human_seconds(res.daly_interval_s))
    t.add_row("expected goodput on spot", f"{res.spot_goodput:.1%}")
    t.add_row("expected goodput on-demand", f"{res.on_demand_goodput:.1%}")
    t.add_row("spot $ per useful device-hour", f"{res.spot_effective_usd_per_useful_hour:.2f}")
    t.add_row("on-demand $ per useful device-hour",
              f"{res.on_demand_effective_usd_per_useful_hour:.2f}")
    t.add_row("saving with spot", f"{res.savings_fraction:.1%}")
    t.add_row("wall time on spot / on-demand", f"{res.wall_time_factor:.2f}x")
    be = res.break_even_preemptions_per_instance_hour
    t.add_row("spot stops paying above (preemptions/instance-h)", f"{be:.3f}" if be else "-")
    console.print(t)


# --- check -----------------------------------------------------------------------------------


def _read_run(run_dir: Path) -> dict[str, Any]:
    from hpcml.errors import RunDirError
    from hpcml.records import read_summary

    path = run_dir / "summary.json"
    if not path.is_file():
        raise RunDirError(f"{run_dir} has no summary.json; pass a folder `hpcml train` finished "
                          "(or let it finish).")
    try:
        return read_summary(run_dir)
    except json.JSONDecodeError:
        raise RunDirError(f"{path} is not valid JSON; the run may have been cut off while "
                          "writing it.") from None


@app.command("check")
def check_cmd(
    run_dir: Path = typer.Argument(..., help="Run folder with summary.json."),
    calibrate_with: list[Path] = typer.Option(
        None, "--calibrate-with", help="Other run folders on the same hardware (repeat)."
    ),
    efficiency: float | None = EFF_OPT,
    overhead: float = OVERHEAD_OPT,
    include_data_wait: bool = typer.Option(
        False, "--include-data-wait", help="Compare against step time with the data wait."
    ),
    catalog: list[Path] = CATALOG_OPT, json_out: bool = JSON_OPT,
) -> None:
    """Predict a measured run and print prediction, measurement and their ratio."""
    from hpcml.plan.check import check_run, setup_from_summary
    from hpcml.plan.perf import Calibration

    cat = _catalog(catalog)
    setup = setup_from_summary(_read_run(run_dir), cat, str(run_dir), include_data_wait)
    others = [setup_from_summary(_read_run(p), cat, str(p), include_data_wait)
              for p in calibrate_with or []]
    cal = Calibration(efficiency, overhead, "--efficiency") if efficiency is not None else None
    report = check_run(setup, others, cal)
    if json_out:
        print_json(report.to_dict())
        return
    d = report.to_dict()
    t = Table(title=f"{run_dir}: {d['model']} ({d['parameters']:,} params) on {d['world_size']} x "
              f"{d['accelerator']}, {d['precision']}/{d['weights']} {d['optimizer']}, "
              f"micro-batch {d['micro_batch']}")
    for col in ("quantity", "predicted", "measured", "predicted / measured", "goal"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for r in report.rows:
        fmt = (lambda v: "-" if v is None else f"{v * 1e3:.2f} ms") if r.quantity.endswith(
            "_s") else (lambda v: "-" if v is None else f"{v:,.0f}")
        ratio = r.ratio
        mark = "" if r.ok is None else (" ok" if r.ok else " MISS")
        t.add_row(r.quantity, fmt(r.predicted), fmt(r.measured),
                  "-" if ratio is None else f"{ratio:.3f}{mark}", f"±{r.goal:.0%}")
    console.print(t)
    cal_d = report.calibration
    console.print(f"calibration: efficiency {cal_d.efficiency:.3g}, overhead "
                  f"{cal_d.overhead_s * 1e3:.2f} ms/step ({cal_d.source})")
    for note in report.notes:
        console.print(f"note: {note}")
