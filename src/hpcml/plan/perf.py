"""Step time, throughput and MFU of a training layout, their scaling over device counts, and
the calibration of the compute efficiency from measured step times.

step = (m + (p-1)/v) x (compute + critical communication per micro-batch)
       + exposed data-parallel communication + optimizer step
       + software time: a fixed overhead + collectives per step x cost per collective
         + parameter tensors x micro-batches x cost per tensor (more under tensor parallelism),
with the pipeline bubble of Narayanan et al. 2021 (Sec. 2.2) and MFU as PaLM defines it
(Chowdhery et al. 2022, Appendix B).

The software cost per collective is a property of the hardware and its communication stack
(the framework's bookkeeping around each call: FSDP2's copy-in and copy-out, DTensor's
redistribution, gloo's TCP round trips), which the link's alpha-beta model does not hold. It
is zero unless fitted: calibrated from measured runs with different collective counts, and
with ZeRO-3's collectives counted per gathered unit, it took hpcml's own CPU table from 10 to
17 of 29 runs within 25%, out of sample, on the same measurements (benchmarks/plan_check.py).
The cost per parameter tensor (the framework's dispatch of each layer's operations, and
DTensor's sharding propagation on top under tensor parallelism), with a CPU rank's peak taken
from the threads it computes with (`Accelerator.per_threads`), took that table to 25 of 29
(on the AMD EPYC machine of 2026-11-23; 20 of 29 on the 2-core Xeon of 2026-11-26). The form
of this model cannot do better than `hpcml.plan.floor` says on a set of runs: on that Xeon
table, no calibration puts the mlp's five runs within 34%.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hpcml.plan.comm import (
    DDP_BUCKET_BYTES,
    CommItem,
    Group,
    collective_time,
    groups,
    step_communication,
)
from hpcml.plan.common import PlanError
from hpcml.plan.hardware import Cluster
from hpcml.plan.memory import (
    OPTIMIZER_TRAFFIC_BYTES,
    Layout,
    Training,
    params_per_device,
)
from hpcml.plan.shapes import ModelShape

HOST_MEMORY_BANDWIDTH = 50e9  # a two-socket server's practical DRAM bandwidth, for offload
HOST_LINK_BANDWIDTH = 25e9  # PCIe 4.0 x16 in practice, for offload transfers


@dataclass(frozen=True)
class Calibration:
    """Compute efficiency (share of dense peak) and a fixed per-step overhead."""

    efficiency: float
    overhead_s: float = 0.0
    source: str = "catalog default"
    residuals: tuple[float, ...] = field(default=())
    """measured / predicted of each calibration point after fitting."""
    collective_overhead_s: float = 0.0
    """software time per collective call, exposed (not hidden behind compute)."""
    tensor_overhead_s: float = 0.0
    """software time per parameter tensor and micro-batch: the dispatch and kernel launches of
    the layer that owns it in forward and backward, and its share of the optimizer step."""
    tp_tensor_overhead_s: float = 0.0
    """the same, added under tensor parallelism (DTensor's sharding propagation per op)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "efficiency": self.efficiency,
            "overhead_s": self.overhead_s,
            "collective_overhead_s": self.collective_overhead_s,
            "tensor_overhead_s": self.tensor_overhead_s,
            "tp_tensor_overhead_s": self.tp_tensor_overhead_s,
            "source": self.source,
            "residuals": list(self.residuals),
        }


@dataclass(frozen=True)
class StepEstimate:
    devices: int
    dp: int
    layout: Layout
    samples_per_step: int
    tokens_per_step: int
    microbatch_compute_s: float
    compute_s: float
    critical_comm_s: float
    bubble_s: float
    dp_comm_s: float
    exposed_dp_comm_s: float
    optimizer_s: float
    overhead_s: float
    step_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    peak_flops_per_device: float
    efficiency: float
    comm: tuple[CommItem, ...] = ()

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs / (time x devices x peak), PaLM Appendix B."""
        return self.model_flops_per_step / (self.step_s * self.devices * self.peak_flops_per_device)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: recomputation counted."""
        return self.hardware_flops_per_step / (
            self.step_s * self.devices * self.peak_flops_per_device
        )

    @property
    def exposed_comm_s(self) -> float:
        return self.critical_comm_s + self.exposed_dp_comm_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "dp": self.dp,
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "zero": self.layout.zero,
            "micro_batch": self.layout.micro_batch,
            "grad_accum": self.layout.grad_accum,
            "recompute": self.layout.recompute,
            "samples_per_step": self.samples_per_step,
            "tokens_per_step": self.tokens_per_step,
            "compute_s": self.compute_s,
            "critical_comm_s": self.critical_comm_s,
            "bubble_s": self.bubble_s,
            "dp_comm_s": self.dp_comm_s,
            "exposed_dp_comm_s": self.exposed_dp_comm_s,
            "optimizer_s": self.optimizer_s,
            "overhead_s": self.overhead_s,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "efficiency": self.efficiency,
            "comm": [c.to_dict() for c in self.comm],
        }


def optimizer_step_s(
    model: ModelShape, layout: Layout, training: Training, cluster: Cluster, dp: int
) -> float:
    """The optimizer step is memory-bound: bytes it reads and writes over memory bandwidth."""
    n = params_per_device(model, layout) / (dp if layout.zero >= 1 else 1)
    traffic = OPTIMIZER_TRAFFIC_BYTES[training.optimizer]
    if training.weight_mode == "mixed":
        traffic += 10.0  # read and write the fp32 master, write the half-precision copy
    if layout.offload != "none":
        # ZeRO-Offload: the step runs on the host, gradients go down and parameters come back.
        moved = n * (training.grad_bytes + training.param_bytes)
        return n * traffic / HOST_MEMORY_BANDWIDTH + moved / HOST_LINK_BANDWIDTH
    return n * traffic / cluster.accelerator.memory_bandwidth_bytes_per_s


def tensor_dispatches(model: ModelShape, layout: Layout) -> float:
    """Parameter tensors of a pipeline stage x micro-batches: what the per-tensor software
    cost multiplies (0 for a model given by its parameter count alone)."""
    return model.param_tensors / layout.pp * layout.grad_accum


def tp_tensor_dispatches(model: ModelShape, layout: Layout) -> float:
    return tensor_dispatches(model, layout) if layout.tp > 1 else 0.0


def step_time(
    model: ModelShape,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    calibration: Calibration | None = None,
    overlap: float = 1.0,
) -> StepEstimate:
    """Predicted time of one optimizer step on the busiest device.

    `overlap` is the share of the overlap window (the last micro-batch's backward for
    data-parallel gradients, each micro-batch's compute for ZeRO-3 prefetches) that
    communication actually hides behind.
    """
    if not 0.0 <= overlap <= 1.0:
        raise PlanError(f"--overlap {overlap} must lie between 0 and 1.")
    dp = layout.validate(model, cluster.devices)
    cal = calibration or Calibration(cluster.accelerator.default_efficiency)
    if cal.efficiency <= 0:
        raise PlanError(f"efficiency {cal.efficiency} must be positive.")
    peak = cluster.accelerator.peak(training.precision)
    m, b = layout.grad_accum, layout.micro_batch
    v = layout.virtual_stages if layout.schedule == "interleaved" else 1

    hw_per_sample = model.hardware_flops_per_sample(layout.recompute)
    t_mb = hw_per_sample * b / (layout.tp * layout.pp) / (peak * cal.efficiency)

    items = step_communication(model, layout, training, cluster)
    critical = sum(c.time_s for c in items if c.overlap == "none" and not c.name.startswith("ZeRO"))
    zero_gather = sum(c.time_s for c in items if c.overlap == "none" and c.name.startswith("ZeRO"))
    critical_mb = critical / m
    per_mb = t_mb + critical_mb
    compute = m * per_mb
    bubble = (layout.pp - 1) / v * per_mb

    dp_items = [c for c in items if c.overlap == "backward"]
    dp_comm = sum(c.time_s for c in dp_items)
    exposed = zero_gather
    if dp_items:
        # Gradients are reduced in buckets while the backward pass (2/3 of a micro-batch's
        # compute) still runs; the last bucket can only start once backward has finished.
        _, dp_g, _ = groups(cluster, layout)
        grad_size = params_per_device(model, layout) * training.grad_bytes
        window = overlap * (2.0 / 3.0) * t_mb
        for item in dp_items:
            last_bucket = collective_time(
                item.op, min(grad_size, DDP_BUCKET_BYTES), cluster, dp_g
            ).time_s
            t = item.time_per_call_s
            exposed += item.calls_per_step * max(min(t, last_bucket), t - window)
    z3 = [c for c in items if c.overlap == "compute"]
    if z3:
        per_mb_comm = sum(c.time_s for c in z3) / m
        exposed += m * max(0.0, per_mb_comm - overlap * t_mb)
        dp_comm += sum(c.time_s for c in z3)

    opt = optimizer_step_s(model, layout, training, cluster, dp)
    calls = sum(c.calls_per_step for c in items)
    software = (
        cal.overhead_s
        + calls * cal.collective_overhead_s
        + tensor_dispatches(model, layout) * cal.tensor_overhead_s
        + tp_tensor_dispatches(model, layout) * cal.tp_tensor_overhead_s
    )
    step = compute + bubble + exposed + opt + software
    samples = dp * b * m
    return StepEstimate(
        devices=cluster.devices,
        dp=dp,
        layout=layout,
        samples_per_step=samples,
        tokens_per_step=samples * model.tokens_per_sample,
        microbatch_compute_s=t_mb,
        compute_s=m * t_mb,
        critical_comm_s=critical + zero_gather,
        bubble_s=bubble,
        dp_comm_s=dp_comm,
        exposed_dp_comm_s=exposed - zero_gather,
        optimizer_s=opt,
        overhead_s=software,
        step_s=step,
        model_flops_per_step=model.model_flops_per_sample() * samples,
        hardware_flops_per_step=hw_per_sample * samples,
        peak_flops_per_device=peak,
        efficiency=cal.efficiency,
        comm=tuple(items),
    )


def scaling_curve(
    model: ModelShape,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    device_counts: Sequence[int],
    global_batch: int | None = None,
    calibration: Calibration | None = None,
    overlap: float = 1.0,
) -> list[StepEstimate]:
    """Step estimates over device counts: weak scaling (fixed per-device batch), or strong
    scaling when `global_batch` (samples per step) is fixed and gradient accumulation adapts.
    Counts whose layout does not divide are skipped."""
    out: list[StepEstimate] = []
    for n in device_counts:
        c = replace(cluster, devices=n)
        if n % (layout.tp * layout.pp):
            continue
        dp = n // (layout.tp * layout.pp)
        lay = layout
        if global_batch is not None:
            per_replica = global_batch / dp
            if per_replica < layout.micro_batch or per_replica % layout.micro_batch:
                continue
            lay = replace(layout, grad_accum=int(per_replica // layout.micro_batch))
        try:
            out.append(step_time(model, lay, training, c, calibration, overlap))
        except PlanError:
            continue
    if not out:
        raise PlanError(
            "no device count in the scaling curve admits this layout and batch; give counts "
            "divisible by tp x pp whose replicas split the global batch evenly."
        )
    return out


# --- calibration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationPoint:
    model: ModelShape
    layout: Layout
    training: Training
    cluster: Cluster
    measured_step_s: float
    label: str = ""


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _fixed_terms(rel: Sequence[float], cols: Sequence[Sequence[float]]) -> list[float]:
    """Non-negative coefficients x minimising sum (rel - sum_j x_j cols_j)^2 (scipy's
    Lawson-Hanson NNLS; scipy comes with scikit-learn, a dependency)."""
    if not cols:
        return []
    import numpy as np
    from scipy.optimize import nnls

    x, _ = nnls(np.asarray(cols, dtype=float).T, np.asarray(rel, dtype=float))
    return [float(v) for v in x]


def software_counts(p: CalibrationPoint) -> tuple[float, float, float]:
    """What the software costs of a calibration multiply for one run: collective calls per
    step, parameter-tensor dispatches, and those dispatches again under tensor parallelism."""
    calls = sum(
        c.calls_per_step for c in step_communication(p.model, p.layout, p.training, p.cluster)
    )
    return (
        float(calls),
        tensor_dispatches(p.model, p.layout),
        tp_tensor_dispatches(p.model, p.layout),
    )


def calibrate(
    points: Sequence[CalibrationPoint],
    fit_overhead: bool | None = None,
    overlap: float = 1.0,
    fit_collectives: bool | None = None,
    fit_tensors: bool | None = None,
) -> Calibration:
    """Fit the compute efficiency and the software costs that make predicted step times match
    measured ones: per collective call (from three or more points whose collective counts
    differ), per parameter tensor (from three or more points whose tensor counts differ) and
    per tensor under tensor parallelism (when some points use it and some do not), or, where
    tensor counts are unknown or all equal, a fixed per-step overhead (from two or more).

    The per-tensor cost replaces the per-step overhead when both could be fitted: a step's
    framework time grows with the operations it dispatches, and on hpcml's CPU table (29 runs,
    5 models, benchmarks/plan_check.py) a constant beside it took the rows within 25% out of
    sample from 25 to 22 (the mlp, with 6 tensors, got the constant as its software time).

    For a given efficiency the software terms enter linearly, so they are solved in closed
    form (non-negative least squares on relative errors); the efficiency is then the golden-
    section minimum of the squared log-ratios over (1e-5, 4)."""
    if not points:
        raise PlanError("calibration needs at least one measured run.")
    for p in points:
        if not p.measured_step_s > 0:
            raise PlanError(f"run {p.label or '?'} has no positive measured step time.")
    calls, tensors, tp_tensors = (list(c) for c in zip(*map(software_counts, points), strict=True))
    if fit_tensors is None:
        fit_tensors = len(points) >= 3 and len(set(tensors)) > 1
    fit_tp = fit_tensors and any(tp_tensors) and not all(tp_tensors)
    if fit_overhead is None:
        fit_overhead = len(points) >= 2 and not fit_tensors
    if fit_collectives is None:
        fit_collectives = len(points) >= 3 and len(set(calls)) > 1
    measured = [p.measured_step_s for p in points]
    counts = [
        ("overhead", fit_overhead, [1.0] * len(points)),
        ("collective", fit_collectives, calls),
        ("tensor", fit_tensors, tensors),
        ("tp_tensor", fit_tp, tp_tensors),
    ]
    fitted = [
        (name, [n / m for n, m in zip(c, measured, strict=True)]) for name, on, c in counts if on
    ]

    def solve(eff: float) -> tuple[Calibration, float]:
        base = [
            step_time(p.model, p.layout, p.training, p.cluster, Calibration(eff), overlap).step_s
            for p in points
        ]
        rel = [1.0 - b / m for b, m in zip(base, measured, strict=True)]
        x = dict(
            zip([n for n, _ in fitted], _fixed_terms(rel, [c for _, c in fitted]), strict=True)
        )
        cal = Calibration(
            eff,
            x.get("overhead", 0.0),
            collective_overhead_s=x.get("collective", 0.0),
            tensor_overhead_s=x.get("tensor", 0.0),
            tp_tensor_overhead_s=x.get("tp_tensor", 0.0),
        )
        extra = [
            cal.overhead_s
            + cal.collective_overhead_s * n
            + cal.tensor_overhead_s * t
            + cal.tp_tensor_overhead_s * tt
            for n, t, tt in zip(calls, tensors, tp_tensors, strict=True)
        ]
        loss = sum(
            math.log(m / (b + e)) ** 2 for m, b, e in zip(measured, base, extra, strict=True)
        )
        return cal, loss

    log_eff = _golden_min(lambda le: solve(math.exp(le))[1], math.log(1e-5), math.log(4.0))
    cal, _ = solve(math.exp(log_eff))
    residuals = tuple(
        p.measured_step_s / step_time(p.model, p.layout, p.training, p.cluster, cal, overlap).step_s
        for p in points
    )
    labels = ", ".join(p.label for p in points if p.label) or f"{len(points)} run(s)"
    return replace(cal, source=f"fitted to {labels}", residuals=residuals)


def group_for(cluster: Cluster) -> Group:
    """All devices of a cluster as one communicator."""
    return Group(cluster.devices, min(cluster.devices, cluster.devices_per_node))
