"""Observers a run starts from its config: `train.profile`, `observe.metrics_port` and
`observe.tracing` (OpenTelemetry spans for each step and its phases: data, forward, backward,
optimizer; and for evaluation and checkpoints).

`train.profile`: torch.profiler over a few steps of a real run, a Chrome/Perfetto trace per
rank, and a breakdown of step time that says where it goes.

The Trainer marks its phases with `record_function` ranges (`hpcml.data`, `hpcml.forward`,
`hpcml.backward`, `hpcml.optimizer`) only while profiling. Per profiled step (the profiler's
`ProfilerStep#N` range) the breakdown is:

- data: waiting for the next batch (`hpcml.data`);
- compute: forward + backward + optimizer (with DDP, backward includes waiting for the last
  gradient all-reduce);
- other: the rest of the step's wall time (hooks, logging, Python between phases);
- communication in flight: the time a collective (c10d / gloo / NCCL ops, found by name, on any
  thread) was running. It overlaps compute, so it is not a fourth slice: 30% means a collective
  was in flight during 30% of the step.

Data, compute and other add up to the step's wall time by definition; what a test can check is
how they move (no collective on one process; data grows with a slow loader). Top ops are by
self CPU time (on CUDA, also by device time).

These are host ranges: on a GPU, the host's forward returns once its kernels are queued, so
time the device spends computing shows up wherever the host waits for it. A CUDA run's
breakdown therefore has a `device` part from the device timeline of the same steps
(hpcml.observe.device_timeline): compute, exposed communication, memcpy, and idle split into
data wait and host overhead.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from hpcml.observe.device_timeline import device_breakdown
from hpcml.observe.tracing import NO_ENDPOINT
from hpcml.observe.tracing import flush_tracer as flush_tracer
from hpcml.observe.tracing import start_tracer as start_tracer_for

PHASES = ("hpcml.data", "hpcml.forward", "hpcml.backward", "hpcml.optimizer")
COMM_MARKERS = (
    "c10d::",
    "gloo",
    "nccl",
    "allreduce",
    "all_reduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "record_param_comms",
    "alltoall",
)


def is_comm(name: str) -> bool:
    """A collective's range (c10d, gloo, NCCL, functional collectives), found by name. ATen ops
    are never collectives, whatever their name says (`aten::broadcast_tensors`)."""
    low = name.lower()
    return not low.startswith("aten::") and any(m in low for m in COMM_MARKERS)


@contextlib.contextmanager
def no_phase(_name: str, **_attributes: Any) -> Iterator[None]:
    yield


def make_phase(profiler: StepProfiler | None, tracer: Any) -> Any:
    """The Trainer's `phase(name, **attributes)`: a profiler range and/or a tracing span, or
    nothing at all when neither is on (the default: no cost per step)."""
    if profiler is None and tracer is None:
        return no_phase

    @contextlib.contextmanager
    def phase(name: str, **attributes: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if profiler is not None:
                stack.enter_context(profiler.phase(name))
            if tracer is not None:
                attrs = {f"hpcml.{k}": v for k, v in attributes.items()}
                stack.enter_context(tracer.start_as_current_span(name, attributes=attrs))
            yield

    return phase


def start_tracer(cfg: Any, rt: Any, out_dir: Path) -> Any:
    """An OpenTelemetry tracer for `observe.tracing`, or None (hpcml.observe.tracing)."""
    if not cfg.observe.tracing:
        return None
    resource = {"service.name": "hpcml-train", "hpcml.run": out_dir.name, "hpcml.rank": rt.rank}
    tracer = start_tracer_for("hpcml.train", resource, "observe.tracing")
    if tracer is None and rt.is_main:
        print(NO_ENDPOINT.format(what="observe.tracing"), file=sys.stderr, flush=True)
    return tracer


def start_profiler(cfg: Any, rt: Any, out_dir: Path) -> StepProfiler | None:
    p = cfg.train.profile
    if p is None:
        return None
    return StepProfiler(p.wait, p.warmup, p.active, out_dir / "profile", rt.rank, rt.device)


def start_exporter(cfg: Any, rt: Any, out_dir: Path, load_s: float | None = None) -> Any:
    """This rank's Prometheus endpoint (`observe.metrics_port`), or None. `load_s`: how long
    the resume's checkpoint load took."""
    o = cfg.observe
    if o.metrics_port is None:
        return None
    from hpcml.observe.train_metrics import TrainExporter

    exporter = TrainExporter(
        o.metrics_port,
        o.metrics_address,
        out_dir,
        rt.rank,
        rt.local_rank,
        o.job,
        rt.device.index if rt.device.type == "cuda" else None,
        Path(o.targets_dir).expanduser() if o.targets_dir else None,
        tls=o.tls,
    )
    history = {"elastic": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)}
    if rt.is_main:  # the run log's writer; its counts are the run's, once
        history.update(run_history(out_dir / "run.jsonl"))
    exporter.started(load_s, history)
    return exporter


def run_history(log: Path) -> dict[str, int]:
    """How often the run in this log was resumed, and resumed after a preemption."""
    counts = {"resume": 0, "preemption": 0}
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        if '"resume"' not in line and '"preempted"' not in line:
            continue  # most lines are steps: not parsed
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "resume":
            counts["resume"] += 1
        elif rec.get("kind") == "fault" and rec.get("event") == "preempted":
            counts["preemption"] += 1
    return counts


def gpu_preflight(cfg: Any, rt: Any) -> None:
    """NVML health checks of this rank's GPU (hpcml.observe.gpu_health): one line per problem
    on stderr; with `observe.strict_health` (--strict-health) a problem stops the run before
    it starts. On a run without a GPU, with `strict_health` set, one line says there was nothing
    to check."""
    from hpcml.observe.gpu_health import preflight

    found = preflight(rt.device)
    if found is None and cfg.observe.strict_health and rt.is_main:
        print(
            f"observe.strict_health: this run trains on {rt.device.type}, not on a GPU NVML can "
            "read; there is nothing to check.",
            file=sys.stderr,
            flush=True,
        )
    if not found:
        return
    for line in found:
        print(f"rank {rt.rank}: {line}", file=sys.stderr, flush=True)
    if cfg.observe.strict_health:
        from hpcml.errors import WorkFailed

        raise WorkFailed(
            f"rank {rt.rank} found {len(found)} GPU health problem(s) (above) and "
            "observe.strict_health refuses to train on it; fix them, or run without "
            "--strict-health to train anyway."
        )


@contextlib.contextmanager
def _without_kineto_usdt() -> Iterator[None]:
    """Kineto (C++, fd 2) prints a `USDT:` line at every profiler start and stop, and no setting
    turns it off (KINETO_LOG_LEVEL does not): hold fd 2 in a temporary file meanwhile and write
    every other line back, so a profiled run's stderr carries only what it always did."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                ln for ln in held.read().splitlines(keepends=True) if not ln.startswith(b"USDT:")
            ]
            if kept:
                os.write(2, b"".join(kept))


class StepProfiler:
    """One rank's profiler: `step()` at each optimizer step, `phase(name)` around phases. On a
    CUDA `device` it records the device's kernels and copies too (the breakdown's `device`
    part, hpcml.observe.device_timeline) and the caching allocator's history."""

    def __init__(
        self,
        wait: int,
        warmup: int,
        active: int,
        out_dir: Path,
        rank: int,
        device: torch.device | None = None,
    ) -> None:
        self.device = device if device is not None and device.type == "cuda" else None
        activities = [ProfilerActivity.CPU]
        if self.device is not None:
            activities.append(ProfilerActivity.CUDA)
        self.out_dir, self.rank, self.active = out_dir, rank, active
        self.done = False
        self.breakdown: dict[str, Any] | None = None
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=False,
            profile_memory=False,
        )
        self.prof.__enter__()
        if self.device is not None:
            # The CUDA caching allocator's history, for https://pytorch.org/memory_viz.
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.done:
            yield
            return
        with record_function(name):
            yield

    def step(self) -> None:
        if not self.done:
            with _without_kineto_usdt():
                self.prof.step()

    def close(self) -> None:
        if not self.done:
            with _without_kineto_usdt():
                self.prof.__exit__(None, None, None)
            self.done = True

    def summary(self) -> dict[str, Any]:
        """The breakdown with the 5 costliest ops (the whole table stays in the profile folder)."""
        out = dict(self.breakdown or {})
        if "top_ops" in out:
            out["top_ops"] = out["top_ops"][:5]
        return out

    def _ready(self, prof: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # *.pt.trace.json: the name TensorBoard's profiler plugin looks for.
        trace = self.out_dir / f"trace-rank-{self.rank}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        self.breakdown = breakdown(prof.events())
        self.breakdown["top_ops"] = top_ops(prof)
        if self.device is not None:
            self.breakdown["device"] = device_breakdown(
                json.loads(trace.read_text()), self.device.index
            )
            # Written for PyTorch's memory viewer; hpcml never reads it back.
            snapshot = self.out_dir / f"memory-snapshot-rank-{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.breakdown["cuda_max_memory_allocated_bytes"] = peak
            self.breakdown["memory_snapshot"] = snapshot.name
        (self.out_dir / f"breakdown-rank-{self.rank}.json").write_text(
            json.dumps(self.breakdown, indent=1)
        )
        self.done = True


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def breakdown(events: Any) -> dict[str, Any]:
    """Median over the profiled steps of each part of a step, in seconds and as a share."""
    steps = [e for e in events if e.name.startswith("ProfilerStep")]  # "ProfilerStep*"
    main = {e.thread for e in steps}  # the training loop's thread
    phases = [e for e in events if e.name in PHASES and e.thread in main]
    # Collectives run on their own threads (gloo) or streams (NCCL): every thread counts, and
    # nested ranges (c10d op -> gloo op) count once through the union.
    comm = _union([(e.time_range.start, e.time_range.end) for e in events if is_comm(e.name)])
    per_step = []
    for s in steps:
        s0, s1 = s.time_range.start, s.time_range.end
        part = {p: 0.0 for p in PHASES}
        for e in phases:
            part[e.name] += _overlap(s0, s1, e.time_range.start, e.time_range.end)
        wall = s1 - s0
        work = part["hpcml.forward"] + part["hpcml.backward"] + part["hpcml.optimizer"]
        per_step.append(
            {
                "step_s": wall / 1e6,
                "data_s": part["hpcml.data"] / 1e6,
                "compute_s": work / 1e6,
                "other_s": max(0.0, wall - work - part["hpcml.data"]) / 1e6,
                "communication_in_flight_s": sum(_overlap(s0, s1, a, b) for a, b in comm) / 1e6,
            }
        )
    if not per_step:
        return {"steps": 0}
    out: dict[str, Any] = {"steps": len(per_step)}
    for key in per_step[0]:
        out[key] = statistics.median(p[key] for p in per_step)
    for key in ("data_s", "compute_s", "other_s", "communication_in_flight_s"):
        out[key.removesuffix("_s") + "_share"] = out[key] / out["step_s"] if out["step_s"] else 0.0
    return out


def top_ops(prof: Any, n: int = 15) -> list[dict[str, Any]]:
    rows = []
    for avg in prof.key_averages():
        if avg.key.startswith(("ProfilerStep", "hpcml.")):
            continue
        rows.append(
            {
                "op": avg.key,
                "calls": int(avg.count),
                "self_cpu_s": avg.self_cpu_time_total / 1e6,
                "device_s": getattr(avg, "self_device_time_total", 0.0) / 1e6,
            }
        )
    rows.sort(key=lambda r: (r["device_s"], r["self_cpu_s"]), reverse=True)
    return rows[:n]
