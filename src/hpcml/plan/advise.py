"""Search parallel layouts for a model, a global batch and a cluster: drop what does not fit,
rank the rest by predicted throughput, and say in one line why the winner wins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hpcml.plan.common import GB, PlanError, divisors
from hpcml.plan.hardware import Cluster
from hpcml.plan.headroom import THIN_HEADROOM, headroom_verdict
from hpcml.plan.memory import (
    CUDA_RESERVE_BYTES,
    USABLE_FRACTION,
    Layout,
    MemoryBreakdown,
    Training,
    per_device_bytes,
)
from hpcml.plan.perf import Calibration, StepEstimate, step_time
from hpcml.plan.shapes import ModelShape


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    estimate: StepEstimate

    def label(self) -> str:
        lay = self.layout
        parts = [
            f"dp={self.estimate.dp}",
            f"tp={lay.tp}" + ("+sp" if lay.sp else ""),
            f"pp={lay.pp}",
        ]
        if lay.schedule == "interleaved":
            parts[-1] += f"x{lay.virtual_stages}"
        parts += [
            f"ZeRO-{lay.zero}",
            f"mb={lay.micro_batch}x{lay.grad_accum}",
            f"recompute={lay.recompute}",
        ]
        if lay.offload != "none":
            parts.append(f"offload={lay.offload}")
        if lay.accum_reduce != "step":
            parts.append(f"accum_reduce={lay.accum_reduce}")
        return " ".join(parts)


@dataclass(frozen=True)
class Advice:
    candidates: tuple[Candidate, ...]
    """Fitting layouts, fastest first."""
    considered: int
    rejected_memory: int
    why: str
    usable_bytes: float | None
    notes: tuple[str, ...] = field(default=())


_TERMS = (
    ("compute", lambda e: e.compute_s),
    ("communication on the critical path", lambda e: e.critical_comm_s),
    ("exposed data-parallel communication", lambda e: e.exposed_dp_comm_s),
    ("the pipeline bubble", lambda e: e.bubble_s),
    ("the optimizer step", lambda e: e.optimizer_s),
)


def _per_sample(c: Candidate) -> float:
    return c.estimate.step_s / c.estimate.samples_per_step


def _fit_line(best: Candidate, rest: Sequence[Candidate], usable: float | None) -> str:
    """The winner's memory and headroom; where the margin is thin (under THIN_HEADROOM of the
    budget), the fastest slower layout that leaves more, and its price in speed."""
    if not usable:
        return "fits in host memory"
    total = best.memory.total_bytes
    verdict, thin = headroom_verdict(total, usable)
    line = f"needs {total / GB:.1f} of {usable / GB:.1f} GB usable and {verdict}"
    roomy = [c for c in rest if not headroom_verdict(c.memory.total_bytes, usable)[1]]
    if thin and roomy:
        cost = _per_sample(roomy[0]) / _per_sample(best) - 1.0
        line += (
            f"; the fastest layout with {THIN_HEADROOM:.0%} headroom, {roomy[0].label()}, "
            f"is {cost:.1%} slower"
        )
    return line


def _why(
    best: Candidate,
    others: Sequence[Candidate],
    model: ModelShape,
    usable: float | None,
    rest: Sequence[Candidate] = (),
) -> str:
    e = best.estimate
    rate = (
        f"{e.tokens_per_s:,.0f} tokens/s"
        if model.is_transformer
        else (f"{e.samples_per_s:,.0f} samples/s")
    )
    line = f"{best.label()} wins at {rate} (MFU {e.mfu:.0%}): it {_fit_line(best, rest, usable)}"
    if not others:
        return line + "; no other layout fits."
    runner = others[0]
    r = runner.estimate
    slower = r.step_s / e.step_s - 1.0
    deltas = [(name, f(r) - f(e)) for name, f in _TERMS]
    name, delta = max(deltas, key=lambda x: x[1])
    reason = (
        f"mostly from {name} (+{delta:.3g} s per step)"
        if delta > 0
        else "for no single dominant reason"
    )
    tie = " - a tie within the model's accuracy" if slower < 0.02 else ""
    return f"{line}; the runner-up ({runner.label()}) is {slower:.1%} slower, {reason}{tie}."


def _policies(model: ModelShape, recompute: Sequence[str]) -> Sequence[str]:
    """The recomputation policies worth searching: attention-scores only where the model's
    attention keeps the scores (eager); none for models without blocks."""
    if not model.is_transformer:
        return ("none",)
    return [rc for rc in recompute if rc != "attention-scores" or model.attention == "eager"]


def advise(
    model: ModelShape,
    training: Training,
    cluster: Cluster,
    global_batch: int,
    top: int = 5,
    usable_fraction: float = USABLE_FRACTION,
    reserve_bytes: float = CUDA_RESERVE_BYTES,
    calibration: Calibration | None = None,
    overlap: float = 1.0,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    recompute: Sequence[str] = ("none", "attention-scores", "op", "full"),
    max_tp: int | None = None,
    max_micro_batch: int = 64,
    offload: Sequence[str] = ("none",),
) -> Advice:
    """Rank every layout of `cluster.devices` that fits, fastest first.

    Tensor parallelism stays inside a node (Narayanan et al. 2021, Sec. 3.3 takeaway #1),
    pipelines only combine with ZeRO-0/1, and sequence parallelism is always on with TP, since
    it costs no extra communication (Korthikanti et al. 2022, Sec. 4.2.2).
    """
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch} must be at least 1.")
    n = cluster.devices
    usable = (
        usable_fraction * cluster.accelerator.memory_bytes - reserve_bytes
        if cluster.accelerator.memory_bytes
        else None
    )
    tp_cap = min(max_tp or cluster.devices_per_node, cluster.devices_per_node)
    if model.is_transformer:
        tps = [
            t
            for t in divisors(n)
            if t <= tp_cap and model.heads % t == 0 and (model.kv_heads or model.heads) % t == 0
        ]
    else:
        tps = [1]
    fitting: list[Candidate] = []
    considered = rejected = 0
    smallest: float | None = None
    for tp in tps:
        pps = [p for p in divisors(n // tp) if p <= model.layers] if model.is_transformer else [1]
        for pp in pps:
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for mb in [d for d in divisors(per_replica) if d <= max_micro_batch]:
                m = per_replica // mb
                schedules: list[tuple[str, int]] = [("1f1b", 1)]
                if pp > 1 and m % pp == 0 and model.layers % (pp * 2) == 0:
                    schedules.append(("interleaved", 2))
                for sched, v in schedules:
                    for zero in zero_stages:
                        if pp > 1 and zero >= 2:
                            continue
                        for rc in _policies(model, recompute):
                            for off in offload:
                                if off == "params" and zero != 3:
                                    continue
                                lay = Layout(
                                    tp=tp,
                                    pp=pp,
                                    zero=zero,
                                    sp=tp > 1,
                                    schedule=sched,
                                    virtual_stages=v,
                                    micro_batch=mb,
                                    grad_accum=m,
                                    recompute=rc,
                                    offload=off,
                                    # ZeRO-2/3 accumulating: reduce-scatter every micro-batch
                                    # (FSDP2's own default, torchtitan's; hpcml's
                                    # parallel.accum_reduce=micro_batch), or the unsharded
                                    # gradients of `step` would be held through the accumulation.
                                    accum_reduce="micro_batch" if zero >= 2 and m > 1 else "step",
                                )
                                considered += 1
                                try:
                                    mem = per_device_bytes(
                                        model, lay, training, n, cluster.accelerator.memory_bytes
                                    )
                                except PlanError:
                                    continue
                                if smallest is None or mem.total_bytes < smallest:
                                    smallest = mem.total_bytes
                                if usable is not None and mem.total_bytes > usable:
                                    rejected += 1
                                    continue
                                est = step_time(model, lay, training, cluster, calibration, overlap)
                                fitting.append(Candidate(lay, mem, est))
    if considered == 0:
        raise PlanError(
            f"no data-parallel degree of {n} devices divides the global batch of {global_batch}; "
            "choose a global batch that is a multiple of the device count (or of n / (tp x pp))."
        )
    if not fitting:
        need = f"{smallest / GB:.1f} GB" if smallest is not None else "more memory"
        cap = cluster.accelerator.memory_bytes or 0
        raise PlanError(
            f"no layout of {model.name} fits on {n} x {cluster.accelerator.key} "
            f"({cap / GB:.0f} GB each, {usable_fraction:.0%} usable less "
            f"{reserve_bytes / GB:.1f} GB reserve): the smallest needs {need} "
            "per device; add devices, allow offload, or pick hardware with more memory."
        )
    fitting.sort(
        key=lambda c: (c.estimate.step_s / c.estimate.samples_per_step, c.memory.total_bytes)
    )
    best, rest = fitting[0], fitting[1:]

    def structure(c: Candidate) -> tuple[object, ...]:
        lay = c.layout
        return (lay.tp, lay.pp, lay.zero, lay.recompute, lay.schedule, lay.offload)

    # Explain against the best layout that differs in structure, not only in micro-batch.
    alternatives = [c for c in rest if structure(c) != structure(best)] or rest
    why = _why(best, alternatives, model, usable, rest)
    return Advice(tuple(fitting[:top]), considered, rejected, why, usable)
