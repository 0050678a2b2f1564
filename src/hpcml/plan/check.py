"""Predict a measured run and compare: memory per rank and step time, prediction / measurement.

Works on the parsed summary.json of a run folder (the contract `hpcml train` writes); reading
the file is the caller's job, so this module stays free of I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hpcml.plan.calibration import CalibrationPoint
from hpcml.plan.common import PlanError
from hpcml.plan.interval import (
    Interval,
    calibrate_with_error,
    model_group,
    no_interval_reason,
    step_interval,
)
from hpcml.plan.memory import MemoryBreakdown, per_device_bytes
from hpcml.plan.perf import Calibration, StepEstimate, step_time
from hpcml.plan.run_setup import RunSetup as RunSetup
from hpcml.plan.run_setup import refuse_copies, refuse_duplicates
from hpcml.plan.run_setup import setup_from_summary as setup_from_summary
from hpcml.plan.shapes import ModelShape

MEMORY_GOAL = 0.10
STEP_GOAL = 0.25


@dataclass(frozen=True)
class CheckRow:
    quantity: str
    predicted: float | None
    measured: float | None
    goal: float
    interval: Interval | None = None
    """for step time: the prediction's 90% interval (hpcml.plan.interval)."""

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
            **(
                {
                    "interval": self.interval.to_dict(),
                    "inside": None
                    if self.measured is None
                    else self.interval.contains(self.measured),
                }
                if self.interval is not None
                else {}
            ),
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


def _config_key(s: RunSetup) -> str:
    """Runs of one configuration on one hardware (repetitions) share this key."""
    c = s.cluster
    return repr((s.model, s.layout, s.training, s.strategy, c.devices, c.accelerator))


def calibration_points(setups: Sequence[RunSetup]) -> list[CalibrationPoint]:
    """The runs that record a step time, as the points a calibration is fitted on; repeated
    runs of one configuration become one point, their median, with every repetition kept
    (their spread is the calibration's measured noise)."""
    groups: dict[str, list[RunSetup]] = {}
    for s in setups:
        if s.measured_step_s:
            groups.setdefault(_config_key(s), []).append(s)
    points = []
    for runs in groups.values():
        times = tuple(float(r.measured_step_s or 0.0) for r in runs)
        s = runs[0]
        label = s.label if len(runs) == 1 else f"{s.label} (+{len(runs) - 1} repeats)"
        repeats = times if len(runs) > 1 else ()
        points.append(
            CalibrationPoint(
                s.model, s.layout, s.training, s.cluster, statistics.median(times), label, repeats
            )
        )
    return points


def calibrate_from(
    setups: Sequence[RunSetup],
    overlap: float = 1.0,
    group: Callable[[CalibrationPoint], Hashable] = model_group,
) -> Calibration:
    """A calibration of these runs, with its errors out of sample when each group of runs
    (a model, by default) is left out in turn (hpcml.plan.interval)."""
    points = calibration_points(setups)
    if not points:
        raise PlanError("none of the calibration runs records a step time in summary.json.")
    return calibrate_with_error(points, overlap=overlap, group=group)


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


def peak_rows(
    setup: RunSetup, mem: MemoryBreakdown, ranks: Sequence[Mapping[str, Any]], notes: list[str]
) -> list[CheckRow]:
    """The step's peak, predicted (by the run's own traced step where it traced this layout,
    else the formula's phases: MemoryBreakdown.step_peak_bytes) next to the peak measured by
    allocation tracing of a real step on each rank (hpcml.train.peaktrace; CPU runs): the
    busiest rank, then every rank with its own error when there are several."""
    measured = [r.get("traced_peak_bytes") for r in ranks]
    if not any(m is not None for m in measured):
        if _max_over_ranks(ranks, "peak_allocated_bytes") is None:
            notes.append("no traced step peak in summary.json (a CPU run records one)")
        return []
    traced = setup.traced_peak_bytes
    predicted = traced if traced is not None else mem.step_peak_bytes
    step = next((r.get("traced_peak_step") for r in ranks if r.get("traced_peak_step")), None)
    source = "the run's own traced step" if traced is not None else "the formula's phases"
    notes.append(
        f"peak_bytes: predicted by {source}; measured as the most live tensor bytes of step "
        f"{step} on each rank, by allocation tracing as it ran"
    )
    best = max(float(m) for m in measured if m is not None)
    rows = [CheckRow("peak_bytes", predicted, best, MEMORY_GOAL)]
    if traced is not None:
        rows.append(CheckRow("peak_formula_bytes", mem.step_peak_bytes, best, MEMORY_GOAL))
    if len(ranks) > 1:
        rows += [
            CheckRow(
                f"peak_bytes rank {i}", predicted, None if m is None else float(m), MEMORY_GOAL
            )
            for i, m in enumerate(measured)
        ]
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
    refuse_duplicates(setups)
    fits: dict[tuple[Any, str], tuple[Calibration, list[RunSetup]]] = {}
    reports = []
    for s in setups:
        acc = s.cluster.accelerator.key
        if (key(s.model), acc) not in fits:
            others = [
                o
                for o in setups
                if key(o.model) != key(s.model)
                and o.cluster.accelerator.key == acc
                and o.measured_step_s
            ]
            cal = (
                calibrate_from(others, overlap, group=lambda p: key(p.model))
                if others
                else Calibration(0.0)
            )
            fits[(key(s.model), acc)] = cal, others
        cal, others = fits[(key(s.model), acc)]
        if not others:
            reports.append(check_run(s, overlap=overlap))
            continue
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
    refuse_copies([setup], calibration_runs)
    refuse_duplicates(calibration_runs)
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
    if setup.formula_model is not None:
        formula = per_device_bytes(
            setup.formula_model, setup.layout, setup.training, setup.cluster.devices
        )
        measured = _max_over_ranks(ranks, "saved_activation_bytes")
        rows.append(
            CheckRow("activations_formula_bytes", formula.activations_bytes, measured, MEMORY_GOAL)
        )
        if mem.activations_bytes:
            drift = formula.activations_bytes / mem.activations_bytes
            notes.append(f"activations: the formula path / the traced step = {drift:.3f}")
    rows += peak_rows(setup, mem, ranks, notes)
    interval = step_interval(est.step_s, calibration)
    if interval is None:
        notes.append(f"no interval on the step time: {no_interval_reason(calibration)}")
    rows.append(CheckRow("step_time_s", est.step_s, setup.measured_step_s, STEP_GOAL, interval))
    if not ranks:
        notes.append("summary.json has no memory block: memory not compared")
    if setup.status and setup.status != "finished":
        notes.append(f"the run's status is '{setup.status}', not finished")
    if math.isclose(est.step_s, 0.0):
        notes.append("predicted step time is zero")
    return CheckReport(setup, mem, est, calibration, calibrated, tuple(rows), tuple(notes))
