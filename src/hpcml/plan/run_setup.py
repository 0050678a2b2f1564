"""One measured run as the planner sees it (`RunSetup`), read from the summary.json that
`hpcml train` writes, and the refusal of runs that are copies of each other.

Works on the parsed summary; reading the file is the caller's job (no I/O here).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hpcml.plan.common import PlanError, get_path
from hpcml.plan.hardware import Catalog, Cluster, match_accelerator, resolve_cluster
from hpcml.plan.memory import Layout, Training
from hpcml.plan.run_shape import shape_from_run
from hpcml.plan.shapes import ModelShape

# hpcml's zero2 is FSDP2 with reshard_after_forward=False: between steps it holds parameter
# shards like ZeRO-3 (what is measured), and keeps the gathered model from forward to backward.
_STRATEGY_ZERO = {"ddp": 0, "zero1": 1, "zero2": 3, "fsdp": 3, "zero3": 3}


@dataclass(frozen=True)
class RunSetup:
    """What the planner needs to know about one measured run."""

    label: str
    model: ModelShape
    layout: Layout
    training: Training
    cluster: Cluster
    device_name: str
    measured_step_s: float | None
    """Median step time without the time spent waiting for data."""
    measured_memory: tuple[Mapping[str, Any], ...]
    status: str = ""
    notes: tuple[str, ...] = ()
    formula_model: ModelShape | None = None
    """the planner's own shape where `model` takes its activations from the run's traced step
    (plan check reports the formula path beside the trace)."""
    strategy: str = ""
    """parallel.strategy as configured (hpcml's zero2 and zero3 share a planned layout)."""
    run_dir: str = ""
    """where the run was trained (summary.json's run_dir: a copied folder keeps it)."""
    record_sha256: str = ""
    """sha256 of the run's measurements (summary.json's throughput and memory blocks)."""
    traced_peak_bytes: float | None = None
    """the peak per rank of the run's own step traced on fake tensors for its own layout
    (summary.json's memory_trace, when it traced this world size and strategy)."""


def _memory_ranks(memory: Any) -> tuple[Mapping[str, Any], ...]:
    """summary.json's memory block, per rank: hpcml train writes rank 0's figures plus a
    "per_rank" list; also accepted: {"0": {...}}, [{...}], or one flat dict."""
    if isinstance(memory, Mapping) and isinstance(memory.get("per_rank"), list):
        return _memory_ranks(memory["per_rank"])
    if isinstance(memory, Mapping):
        if "model_states_bytes" in memory or "params_bytes" in memory:
            return (memory,)
        ranks = [
            v
            for _, v in sorted(memory.items(), key=lambda kv: str(kv[0]).zfill(6))
            if isinstance(v, Mapping)
        ]
        return tuple(ranks)
    if isinstance(memory, list):
        return tuple(m for m in memory if isinstance(m, Mapping))
    return ()


def _cpu_threads(device: Mapping[str, Any], world: int) -> int | None:
    """Threads one CPU rank computed with: recorded by hpcml train, or for summaries written
    before it was, the rule hpcml's runtime applies (the host's cores split evenly between the
    ranks, all on one host)."""
    if device.get("threads"):
        return int(device["threads"])
    cores = device.get("count")
    return max(1, int(cores) // max(1, world)) if cores else None


def setup_from_summary(
    summary: Mapping[str, Any],
    catalog: Catalog,
    label: str = "run",
    include_data_wait: bool = False,
) -> RunSetup:
    """Turn a run's summary.json (hpcml train's run-folder contract) into a plan."""
    status = str(summary.get("status", ""))
    if status and status != "finished" and "model" not in summary:
        raise PlanError(
            f"{label}: the run ended '{status}' and its summary.json holds no measurements; "
            "check needs a run that finished (resume it with hpcml train --resume auto)."
        )
    config = summary.get("config") or {}
    if not isinstance(config, Mapping):
        raise PlanError(f"{label}: summary.json 'config' is not a mapping; is it a hpcml run?")
    world = int(summary.get("world_size") or 1)
    device = summary.get("device") or {}
    dev_type = str(get_path(device, "type", default="cpu"))
    dev_name = str(get_path(device, "name", default=dev_type))
    acc_key = "cpu" if dev_type == "cpu" else None
    if acc_key is None:
        acc = match_accelerator(catalog, dev_name)
        if acc is None:
            raise PlanError(
                f"{label}: device '{dev_name}' is not in the hardware catalog; add an entry whose "
                "match pattern fits it to a YAML passed with --catalog."
            )
        acc_key = acc.key
    cluster = resolve_cluster(catalog, world, accelerator=acc_key)
    threads = _cpu_threads(device, world) if dev_type == "cpu" else None
    if threads is not None:
        cluster = replace(cluster, accelerator=cluster.accelerator.per_threads(threads))

    precision = str(summary.get("precision") or config.get("precision") or "fp32")
    # hpcml train uses torch autocast for bf16/fp16: weights and gradients stay fp32.
    training_weights = "amp" if precision in ("bf16", "fp16") else "pure"
    opt_name = str(get_path(config, "optim", "name", default="adamw")).lower()
    if opt_name == "sgd" and float(get_path(config, "optim", "momentum", default=0.9) or 0) == 0:
        opt_name = "sgd-nomomentum"
    # hpcml.train.schedule.build_optimizer takes torch's fused kernel (CPU and CUDA have one)
    training = Training(
        precision=precision, optimizer=opt_name, weights=training_weights, fused=True
    )

    strategy = str(get_path(config, "parallel", "strategy", default="ddp")).lower()
    if strategy not in _STRATEGY_ZERO:
        raise PlanError(
            f"{label}: parallel.strategy '{strategy}' is not one the planner maps; known are "
            f"{', '.join(_STRATEGY_ZERO)}."
        )
    tp = int(get_path(config, "parallel", "tp", default=1) or 1)
    ac = str(get_path(config, "train", "activation_checkpointing", default="none"))
    model, shape_notes = shape_from_run(summary, config)
    if strategy == "zero2" and world // tp > 1:
        shape_notes.append(
            "hpcml's zero2 (FSDP2, reshard_after_forward=False) keeps parameter shards between "
            "steps, so model states are predicted as ZeRO-3, and the whole model gathered from "
            "forward to backward as its buffers"
        )
    decay = float(get_path(config, "optim", "weight_decay", default=0.0) or 0.0)
    if model.param_tensor_sizes and (
        decay == 0
        or bool(get_path(config, "optim", "decay_norms_biases_embeddings", default=False))
    ):
        # hpcml.train.schedule.param_groups: one group unless some parameters are exempt from
        # weight decay; ZeroRedundancyOptimizer partitions group by group.
        one = tuple(n for group in model.param_tensor_sizes for n in group)
        model = replace(model, param_tensor_sizes=(one,))
    if ac == "selective":  # hpcml's older name of layer:K, K = train.ac_every
        ac = f"layer:{int(get_path(config, 'train', 'ac_every', default=2) or 2)}"
    if not model.is_transformer and ac != "none":
        shape_notes.append(f"recomputation ({ac}) is planned for transformers only")
        ac = "none"
    layout = Layout(
        tp=tp,
        sp=bool(get_path(config, "parallel", "sequence_parallel", default=False)),
        zero=_STRATEGY_ZERO[strategy] if world // tp > 1 else 0,
        micro_batch=int(get_path(config, "data", "batch_size", default=1)),
        grad_accum=int(get_path(config, "train", "grad_accum", default=1)),
        recompute=ac,
        vocab_parallel_loss=False,  # hpcml's gpt TP plan gathers whole logits
        sp_saves_gathered=True,  # and keeps gathered matmul inputs (torch DTensor SP)
        # hpcml's zero1 is torch's ZeroRedundancyOptimizer: whole tensors per rank. Measured on
        # mlp, the busiest rank held 1.84x the even split the planner used to predict.
        zero1_whole_tensors=strategy == "zero1",
        keep_gathered=strategy == "zero2",
        accum_reduce=str(get_path(config, "parallel", "accum_reduce", default="step")),
    )

    step = get_path(summary, "throughput", "step_time_s")
    wait = get_path(summary, "throughput", "data_wait_s")
    notes: list[str] = list(shape_notes)
    model, formula = _traced_activations(summary, model, layout.tp, notes)
    measured: float | None = None
    if step is not None and float(step) > 0:
        measured = float(step)
        if wait is not None and not include_data_wait and 0 < float(wait) < measured:
            measured -= float(wait)
            notes.append(f"measured step time excludes {float(wait) * 1e3:.1f} ms of data wait")
    return RunSetup(
        label=label,
        model=model,
        formula_model=formula,
        layout=layout,
        training=training,
        cluster=cluster,
        device_name=dev_name,
        measured_step_s=measured,
        measured_memory=_memory_ranks(summary.get("memory")),
        status=str(summary.get("status", "")),
        notes=tuple(notes),
        strategy=strategy,
        run_dir=str(summary.get("run_dir") or ""),
        record_sha256=_record_sha256(summary),
        traced_peak_bytes=_traced_peak(summary, world, strategy, tp),
    )


def _traced_peak(summary: Mapping[str, Any], world: int, strategy: str, tp: int) -> float | None:
    """memory_trace's peak where it traced the run's own layout: its world size, and its
    strategy (one process: `single`)."""
    trace = summary.get("memory_trace")
    if not isinstance(trace, Mapping) or trace.get("peak_bytes") is None or tp > 1:
        return None
    same = int(trace.get("devices") or 0) == world and (
        world == 1 or str(trace.get("strategy")) == strategy
    )
    return float(trace["peak_bytes"]) if same else None


def _traced_activations(
    summary: Mapping[str, Any], model: ModelShape, tp: int, notes: list[str]
) -> tuple[ModelShape, ModelShape | None]:
    """The run's model with the activations its own traced step measured (summary.json's
    `memory_trace`, one replica: not under tensor parallelism), and the formula path's shape
    beside it where the planner has one; the model unchanged without a trace."""
    traced = get_path(summary, "memory_trace", "activations_bytes_per_sample")
    if traced is None or model.activations_traced or tp > 1:
        return model, None
    has_formula = model.is_transformer or model.activation_bytes_per_sample is not None
    notes.append(
        "activations predicted from the run's own traced step (plan memory --trace)"
        + ("; the formula path beside it: activations_formula_bytes" if has_formula else "")
    )
    shape = replace(model, activation_bytes_per_sample=float(traced), activations_traced=True)
    return shape, model if has_formula else None


def _record_sha256(summary: Mapping[str, Any]) -> str:
    measured = {k: summary.get(k) for k in ("throughput", "memory")}
    text = json.dumps(measured, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def copy_of(a: RunSetup, b: RunSetup) -> str | None:
    """Why `b` is the same run as `a` (the same folder, the same run_dir in its summary, or
    the same measurements to the last digit), or None."""
    if a.label == b.label:
        return "is the same folder"
    if a.run_dir and a.run_dir == b.run_dir:
        return f"was trained in the same folder ({a.run_dir})"
    if a.measured_step_s and a.record_sha256 == b.record_sha256:
        return "holds the same measurements to the last digit (a copy)"
    return None


def refuse_copies(checked: Sequence[RunSetup], calibration: Sequence[RunSetup]) -> None:
    """A calibration fitted on a copy of the run it predicts agrees with it by construction,
    and repeats that are copies fake zero noise: both are refused in one sentence."""
    for c in calibration:
        for r in checked:
            why = copy_of(r, c) if r is not c else None
            if why:
                raise PlanError(
                    f"calibration run {c.label} {why} as checked run {r.label}: a run "
                    "calibrated on itself agrees with itself by construction; calibrate on "
                    "other runs of this hardware."
                )


def refuse_duplicates(setups: Sequence[RunSetup]) -> None:
    """Runs checked against each other must be different runs (see refuse_copies)."""
    for i, a in enumerate(setups):
        for b in setups[i + 1 :]:
            why = copy_of(a, b)
            if why:
                raise PlanError(
                    f"run {b.label} {why} as run {a.label}: give each run once; a copy would "
                    "count as a repetition with no noise."
                )
