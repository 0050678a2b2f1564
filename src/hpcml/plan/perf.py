"""Step time, throughput and MFU of a training layout, their scaling over device counts, and
the calibration they are computed with (fitted on measured runs by hpcml.plan.calibration,
its error out of sample in hpcml.plan.interval).

step = (m + (p-1)/v) x (compute + critical communication per micro-batch)
       + exposed data-parallel communication + optimizer step
       + software time: a fixed overhead + calls of each collective kind x its cost per call
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
table, with one cost for every collective kind no calibration puts the mlp's five runs within
34%; with a cost per kind, 6.9%.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    """Compute efficiency (share of dense peak) and the software costs of a step."""

    efficiency: float
    overhead_s: float = 0.0
    source: str = "catalog default"
    residuals: tuple[float, ...] = field(default=())
    """measured / predicted of each calibration point after fitting (in sample)."""
    collective_overhead_s: float = 0.0
    """software time per collective call, exposed (not hidden behind compute); the cost of a
    kind that `collective_costs_s` does not hold."""
    tensor_overhead_s: float = 0.0
    """software time per parameter tensor and micro-batch: the dispatch and kernel launches of
    the layer that owns it in forward and backward, and its share of the optimizer step."""
    tp_tensor_overhead_s: float = 0.0
    """the same, added under tensor parallelism (DTensor's sharding propagation per op)."""
    collective_costs_s: tuple[tuple[str, float], ...] = ()
    """software time per call of each collective kind the calibration runs issued (gloo's
    all-reduce and FSDP2's all-gather differ by their bookkeeping, not only by their bytes)."""
    noise_log: float | None = None
    """run-to-run noise of the calibration runs: the pooled standard deviation of log step time
    over repeated runs of one configuration (None without repeats)."""
    error_log: tuple[float, ...] = ()
    """out-of-sample log(measured / predicted) of the calibration runs, each predicted by a fit
    on the runs of the other models (hpcml.plan.interval turns them into intervals)."""
    error_basis: str = ""
    error_groups: int = 0
    """how many groups (models, or runs of one model) were left out in turn for error_log."""

    def collective_cost_s(self, op: str) -> float:
        return dict(self.collective_costs_s).get(op, self.collective_overhead_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "efficiency": self.efficiency,
            "overhead_s": self.overhead_s,
            "collective_overhead_s": self.collective_overhead_s,
            "collective_costs_s": dict(self.collective_costs_s),
            "tensor_overhead_s": self.tensor_overhead_s,
            "tp_tensor_overhead_s": self.tp_tensor_overhead_s,
            "source": self.source,
            "residuals": list(self.residuals),
            "noise_log": self.noise_log,
            "error_log": list(self.error_log),
            "error_basis": self.error_basis,
            "error_groups": self.error_groups,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        """The calibration a `to_dict` (a `plan check --json` report) holds; a value of the
        wrong type raises ValueError or TypeError."""
        noise = d.get("noise_log")
        kinds = d.get("collective_costs_s") or {}
        return cls(
            float(d["efficiency"]),
            float(d.get("overhead_s") or 0.0),
            str(d.get("source") or ""),
            tuple(float(r) for r in d.get("residuals") or ()),
            float(d.get("collective_overhead_s") or 0.0),
            float(d.get("tensor_overhead_s") or 0.0),
            float(d.get("tp_tensor_overhead_s") or 0.0),
            tuple(sorted((str(k), float(v)) for k, v in kinds.items())),
            None if noise is None else float(noise),
            tuple(float(e) for e in d.get("error_log") or ()),
            str(d.get("error_basis") or ""),
            int(d.get("error_groups") or 0),
        )


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
    software = (
        cal.overhead_s
        + sum(c.calls_per_step * cal.collective_cost_s(c.op) for c in items)
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


def group_for(cluster: Cluster) -> Group:
    """All devices of a cluster as one communicator."""
    return Group(cluster.devices, min(cluster.devices, cluster.devices_per_node))
