"""Predict a measured run and compare: memory per rank and step time, prediction / measurement.

Works on the parsed summary.json of a run folder (the contract `hpcml train` writes); reading
the file is the caller's job, so this module stays free of I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hpcml.plan.common import PlanError
from hpcml.plan.hardware import Catalog, Cluster, match_accelerator, resolve_cluster
from hpcml.plan.memory import Layout, MemoryBreakdown, Training, per_device_bytes
from hpcml.plan.perf import Calibration, CalibrationPoint, StepEstimate, calibrate, step_time
from hpcml.plan.run_shape import shape_from_run
from hpcml.plan.shapes import ModelShape

MEMORY_GOAL = 0.10
STEP_GOAL = 0.25

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


@dataclass(frozen=True)
class CheckRow:
    quantity: str
    predicted: float | None
    measured: float | None
    goal: float

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return self.predicted / self.measured

    @property
    def ok(self) -> bool | None:
        r = self.ratio
        return None if r is None else abs(r - 1.0) <= self.goal

    def to_dict(self) -> dict[str, Any]:
        return {
            "quantity": self.quantity,
            "predicted": self.predicted,
            "measured": self.measured,
            "ratio": self.ratio,
            "goal": self.goal,
            "ok": self.ok,
        }


@dataclass(frozen=True)
class CheckReport:
    setup: RunSetup
    memory: MemoryBreakdown
    estimate: StepEstimate
    calibration: Calibration
    calibrated: bool
    rows: tuple[CheckRow, ...]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {
            "run": s.label,
            "model": s.model.name,
            "parameters": s.model.params,
            "device": s.device_name,
            "accelerator": s.cluster.accelerator.key,
            "world_size": s.cluster.devices,
            "precision": s.training.precision,
            "weights": s.training.weight_mode,
            "optimizer": s.training.optimizer,
            "zero": s.layout.zero,
            "micro_batch": s.layout.micro_batch,
            "grad_accum": s.layout.grad_accum,
            "calibration": self.calibration.to_dict(),
            "calibrated": self.calibrated,
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
            "predicted_memory": self.memory.to_dict(),
            "predicted_step": self.estimate.to_dict(),
        }


def _get(d: Mapping[str, Any], *path: str, default: Any = None) -> Any:
    cur: Any = d
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur:
            return default
        cur = cur[p]
    return cur


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
    dev_type = str(_get(device, "type", default="cpu"))
    dev_name = str(_get(device, "name", default=dev_type))
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
    opt_name = str(_get(config, "optim", "name", default="adamw")).lower()
    if opt_name == "sgd" and float(_get(config, "optim", "momentum", default=0.9) or 0) == 0:
        opt_name = "sgd-nomomentum"
    training = Training(precision=precision, optimizer=opt_name, weights=training_weights)

    strategy = str(_get(config, "parallel", "strategy", default="ddp")).lower()
    if strategy not in _STRATEGY_ZERO:
        raise PlanError(
            f"{label}: parallel.strategy '{strategy}' is not one the planner maps; known are "
            f"{', '.join(_STRATEGY_ZERO)}."
        )
    tp = int(_get(config, "parallel", "tp", default=1) or 1)
    ac = str(_get(config, "train", "activation_checkpointing", default="none"))
    model, shape_notes = shape_from_run(summary, config)
    if strategy == "zero2" and world // tp > 1:
        shape_notes.append(
            "hpcml's zero2 (FSDP2, reshard_after_forward=False) keeps parameter shards between "
            "steps, so model states are predicted as ZeRO-3; the whole model gathered during "
            "forward and backward is not in the prediction's buffers"
        )
    decay = float(_get(config, "optim", "weight_decay", default=0.0) or 0.0)
    if model.param_tensor_sizes and (
        decay == 0 or bool(_get(config, "optim", "decay_norms_biases_embeddings", default=False))
    ):
        # hpcml.train.schedule.param_groups: one group unless some parameters are exempt from
        # weight decay; ZeroRedundancyOptimizer partitions group by group.
        one = tuple(n for group in model.param_tensor_sizes for n in group)
        model = replace(model, param_tensor_sizes=(one,))
    if ac == "selective":  # hpcml's older name of layer:K, K = train.ac_every
        ac = f"layer:{int(_get(config, 'train', 'ac_every', default=2) or 2)}"
    if not model.is_transformer and ac != "none":
        shape_notes.append(f"recomputation ({ac}) is planned for transformers only")
        ac = "none"
    layout = Layout(
        tp=tp,
        sp=bool(_get(config, "parallel", "sequence_parallel", default=False)),
        zero=_STRATEGY_ZERO[strategy] if world // tp > 1 else 0,
        micro_batch=int(_get(config, "data", "batch_size", default=1)),
        grad_accum=int(_get(config, "train", "grad_accum", default=1)),
        recompute=ac,
        vocab_parallel_loss=False,  # hpcml's gpt TP plan gathers whole logits
        sp_saves_gathered=True,  # and keeps gathered matmul inputs (torch DTensor SP)
        # hpcml's zero1 is torch's ZeroRedundancyOptimizer: whole tensors per rank. Measured on
        # mlp, the busiest rank held 1.84x the even split the planner used to predict.
        zero1_whole_tensors=strategy == "zero1",
        accum_reduce=str(_get(config, "parallel", "accum_reduce", default="step")),
    )

    step = _get(summary, "throughput", "step_time_s")
    wait = _get(summary, "throughput", "data_wait_s")
    notes: list[str] = list(shape_notes)
    measured: float | None = None
    if step is not None and float(step) > 0:
        measured = float(step)
        if wait is not None and not include_data_wait and 0 < float(wait) < measured:
            measured -= float(wait)
            notes.append(f"measured step time excludes {float(wait) * 1e3:.1f} ms of data wait")
    return RunSetup(
        label=label,
        model=model,
        layout=layout,
        training=training,
        cluster=cluster,
        device_name=dev_name,
        measured_step_s=measured,
        measured_memory=_memory_ranks(summary.get("memory")),
        status=str(summary.get("status", "")),
        notes=tuple(notes),
    )


def calibration_points(setups: Sequence[RunSetup]) -> list[CalibrationPoint]:
    """The runs that record a step time, as the points a calibration is fitted on."""
    return [
        CalibrationPoint(s.model, s.layout, s.training, s.cluster, s.measured_step_s, s.label)
        for s in setups
        if s.measured_step_s
    ]


def calibrate_from(setups: Sequence[RunSetup], overlap: float = 1.0) -> Calibration:
    points = calibration_points(setups)
    if not points:
        raise PlanError("none of the calibration runs records a step time in summary.json.")
    return calibrate(points, overlap=overlap)


def _max_over_ranks(ranks: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in ranks if r.get(key) is not None]
    return max(values) if values else None


def memory_rows(mem: MemoryBreakdown, ranks: Sequence[Mapping[str, Any]]) -> list[CheckRow]:
    """Predicted memory next to the busiest rank's measurement, quantity by quantity.

    Measured: model states from the optimizer's and model's tensors, saved activations from
    autograd's saved-tensor hooks on one micro-batch (hpcml.train.memprobe), and on CUDA the
    allocator's peak. Their sum is the CPU peak (states + activations)."""

    def row(quantity: str, predicted: float, key: str) -> CheckRow:
        return CheckRow(quantity, predicted, _max_over_ranks(ranks, key), MEMORY_GOAL)

    rows = [
        row("params_bytes", mem.params_bytes, "params_bytes"),
        row("grads_bytes", mem.grads_bytes, "grads_bytes"),
        row("optimizer_bytes", mem.optimizer_bytes, "optimizer_bytes"),
        row("model_states_bytes", mem.model_states_bytes, "model_states_bytes"),
        row("activations_bytes", mem.activations_bytes, "saved_activation_bytes"),
    ]
    sums = [
        float(r["model_states_bytes"]) + float(r["saved_activation_bytes"])
        for r in ranks
        if r.get("model_states_bytes") is not None and r.get("saved_activation_bytes") is not None
    ]
    rows.append(
        CheckRow(
            "states_plus_activations_bytes",
            mem.model_states_bytes + mem.activations_bytes,
            max(sums) if sums else None,
            MEMORY_GOAL,
        )
    )
    if _max_over_ranks(ranks, "peak_allocated_bytes") is not None:
        rows.append(row("peak_allocated_bytes", mem.total_bytes, "peak_allocated_bytes"))
    return rows


def model_key(shape: ModelShape) -> tuple[str, int]:
    """A model is its architecture and size: gpt-tiny at 2 x 64 and at 4 x 128 are two."""
    return shape.name, shape.params


def model_label(shape: ModelShape) -> str:
    return f"{shape.name} ({shape.params / 1e6:.2f}M)"


def leave_one_model_out(
    setups: Sequence[RunSetup], overlap: float = 1.0, hold_out: str = "model"
) -> list[CheckReport]:
    """Each run's step time predicted with a calibration of the hardware fitted on the runs of
    every *other* model on the same hardware, whatever their number of processes (on a CPU
    the peak of a rank follows the threads it computes with: `_cpu_threads`). A model is an
    architecture at one size; `hold_out="family"` leaves out every size of the architecture
    (gpt-tiny at 2 x 64 is then not calibrated with gpt-tiny at 4 x 128). Memory needs no
    calibration."""
    key = model_key if hold_out == "model" else (lambda shape: (shape.name, 0))
    reports = []
    for s in setups:
        others = [
            o
            for o in setups
            if key(o.model) != key(s.model)
            and o.cluster.accelerator.key == s.cluster.accelerator.key
            and o.measured_step_s
        ]
        if not others:
            reports.append(check_run(s, overlap=overlap))
            continue
        cal = calibrate_from(others, overlap)
        rep = check_run(s, calibration=cal, overlap=overlap)
        names = sorted({model_label(o.model) for o in others})
        note = f"step time calibrated on {len(others)} runs of {', '.join(names)} (not this model)"
        reports.append(replace(rep, notes=(*rep.notes, note)))
    return reports


def check_run(
    setup: RunSetup,
    calibration_runs: Sequence[RunSetup] = (),
    calibration: Calibration | None = None,
    overlap: float = 1.0,
) -> CheckReport:
    """Prediction next to measurement for one run; step time after calibration on other runs."""
    notes = list(setup.notes)
    mem = per_device_bytes(
        setup.model,
        setup.layout,
        setup.training,
        setup.cluster.devices,
        setup.cluster.accelerator.memory_bytes,
    )
    calibrated = False
    if calibration is None and calibration_runs:
        for other in calibration_runs:
            if other.cluster.accelerator.key != setup.cluster.accelerator.key:
                notes.append(
                    f"calibration run {other.label} ran on "
                    f"{other.cluster.accelerator.key}, not "
                    f"{setup.cluster.accelerator.key}"
                )
            elif (
                setup.cluster.accelerator.key == "cpu"
                and other.cluster.devices != setup.cluster.devices
            ):
                notes.append(
                    f"calibration run {other.label} used {other.cluster.devices} "
                    "processes; CPU processes share cores, so calibrate with the same "
                    "world size"
                )
            if other.label == setup.label:
                notes.append("the run calibrates itself: its step-time ratio is 1 by construction")
        calibration = calibrate_from(calibration_runs, overlap)
        calibrated = True
    elif calibration is not None:
        calibrated = True
    else:
        calibration = Calibration(setup.cluster.accelerator.default_efficiency)
        notes.append(
            "step time uncalibrated: the catalog's default efficiency is a guess; "
            "pass --calibrate-with RUN_DIR (another run on this hardware)"
        )
    est = step_time(setup.model, setup.layout, setup.training, setup.cluster, calibration, overlap)
    ranks = setup.measured_memory
    rows = memory_rows(mem, ranks)
    if not any(r.quantity == "peak_allocated_bytes" for r in rows):
        notes.append(
            "no allocator peak measured (CPU run): peak compared as model states plus saved "
            "activations"
        )
    rows.append(CheckRow("step_time_s", est.step_s, setup.measured_step_s, STEP_GOAL))
    if not ranks:
        notes.append("summary.json has no memory block: memory not compared")
    if setup.status and setup.status != "finished":
        notes.append(f"the run's status is '{setup.status}', not finished")
    if math.isclose(est.step_s, 0.0):
        notes.append("predicted step time is zero")
    return CheckReport(setup, mem, est, calibration, calibrated, tuple(rows), tuple(notes))
