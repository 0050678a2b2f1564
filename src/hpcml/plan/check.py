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
from hpcml.plan.shapes import ModelShape, model_shape, transformer

MEMORY_GOAL = 0.10
STEP_GOAL = 0.20

_STRATEGY_ZERO = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "zero3": 3}
_DIM_KEYS = {
    "layers": ("n_layer", "n_layers", "num_layers", "layers", "depth"),
    "hidden": ("n_embd", "d_model", "hidden_size", "hidden", "dim"),
    "heads": ("n_head", "n_heads", "num_heads", "heads"),
    "seq": ("block_size", "seq_len", "max_seq_len", "context_length", "seq"),
    "vocab": ("vocab_size", "vocab"),
}


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


def _shape_from_run(summary: Mapping[str, Any], config: Mapping[str, Any]) -> ModelShape:
    name = str(
        _get(config, "model", "name", default=_get(summary, "model", "name", default="model"))
    )
    args = dict(
        _get(config, "model", "args", default=None)
        or _get(summary, "model", "args", default=None)
        or {}
    )
    params = _get(summary, "model", "parameters")
    fwd = _get(summary, "model", "forward_flops_per_sample")
    dims = {k: next((int(args[a]) for a in keys if a in args), 0) for k, keys in _DIM_KEYS.items()}
    if dims["layers"] and dims["hidden"] and dims["heads"]:
        shape = transformer(
            name,
            dims["layers"],
            dims["hidden"],
            dims["heads"],
            dims["seq"] or 256,
            dims["vocab"] or 256,
            params=int(params) if params else None,
            source="run summary",
        )
        return shape
    try:
        shape = model_shape(name, args)
    except PlanError:
        shape = ModelShape(name, int(params or 0), source="run summary")
        try:
            # The engine fills in default arguments (num_classes, in_channels); the table
            # entry still describes the model when its parameter count agrees.
            table = model_shape(name)
            if not params or table.params == int(params):
                shape = table
        except PlanError:
            pass
    if params:
        shape = replace(shape, params=int(params))
    if fwd:
        shape = replace(shape, forward_flops_per_sample=float(fwd))
    if not shape.params:
        raise PlanError(
            f"the run's summary.json gives no parameter count for model '{name}' and the planner "
            "does not know it; the summary needs model.parameters."
        )
    return shape


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
    layout = Layout(
        zero=_STRATEGY_ZERO[strategy] if world > 1 else 0,
        micro_batch=int(_get(config, "data", "batch_size", default=1)),
        grad_accum=int(_get(config, "train", "grad_accum", default=1)),
    )
    model = _shape_from_run(summary, config)

    step = _get(summary, "throughput", "step_time_s")
    wait = _get(summary, "throughput", "data_wait_s")
    notes: list[str] = []
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


def calibrate_from(setups: Sequence[RunSetup], overlap: float = 1.0) -> Calibration:
    points = [
        CalibrationPoint(s.model, s.layout, s.training, s.cluster, s.measured_step_s, s.label)
        for s in setups
        if s.measured_step_s
    ]
    if not points:
        raise PlanError("none of the calibration runs records a step time in summary.json.")
    return calibrate(points, overlap=overlap)


def _max_over_ranks(ranks: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in ranks if r.get(key) is not None]
    return max(values) if values else None


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
    rows = [
        CheckRow(
            "params_bytes", mem.params_bytes, _max_over_ranks(ranks, "params_bytes"), MEMORY_GOAL
        ),
        CheckRow(
            "grads_bytes", mem.grads_bytes, _max_over_ranks(ranks, "grads_bytes"), MEMORY_GOAL
        ),
        CheckRow(
            "optimizer_bytes",
            mem.optimizer_bytes,
            _max_over_ranks(ranks, "optimizer_bytes"),
            MEMORY_GOAL,
        ),
        CheckRow(
            "model_states_bytes",
            mem.model_states_bytes,
            _max_over_ranks(ranks, "model_states_bytes"),
            MEMORY_GOAL,
        ),
    ]
    peak = _max_over_ranks(ranks, "peak_allocated_bytes")
    if peak is not None:
        rows.append(CheckRow("peak_allocated_bytes", mem.total_bytes, peak, MEMORY_GOAL))
    else:
        notes.append("no peak device memory measured (CPU run): only model states compared")
    rows.append(CheckRow("step_time_s", est.step_s, setup.measured_step_s, STEP_GOAL))
    if not ranks:
        notes.append("summary.json has no memory block: memory not compared")
    if setup.status and setup.status != "finished":
        notes.append(f"the run's status is '{setup.status}', not finished")
    if math.isclose(est.step_s, 0.0):
        notes.append("predicted step time is zero")
    return CheckReport(setup, mem, est, calibration, calibrated, tuple(rows), tuple(notes))
