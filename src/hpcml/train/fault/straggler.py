"""Straggler detection: each rank's own compute time per step, compared across ranks every
`fault.straggler_every` steps.

What is timed, per micro-batch: from the model's forward pre-hook to the moment the last
parameter gradient of the backward is accumulated (a `post_accumulate_grad` hook), plus the
optimizer step (the optimizer's step pre/post hooks). Time spent waiting for other ranks is left
out: data-parallel gradient all-reduces run beside the backward and are waited for only after
the last gradient is ready (DDP's finalize), so a fast rank waiting for a slow one does not look
slow itself, as it would with whole-step times. A slow forward, a slow backward and a slow
optimizer step all count.

Under FSDP2 (zero2, zero3, fsdp) gradients reach the sharded parameters through FSDP's
reduce-scatter, not autograd, so no such hook fires, and a fast rank waits for a slow one in
FSDP's parameter all-gathers and gradient reduce-scatters inside forward and backward. There
a micro-batch is timed from the first forward to the end of the last backward, and the time
spent in FSDP's waiting methods (`hpcml.distributed.parallel.wrap_fsdp_waits`) is subtracted.
Under tensor parallelism the forward and backward hold collectives of their own (DTensor's, a
fast rank waits there for a slow one): the time in their waits
(`hpcml.distributed.parallel.wrap_dtensor_waits`) inside a span is subtracted too.
Under pipeline parallelism a stage waits for its neighbours' activations and gradients between
its own chunks, inside such spans; on the CPU a rank's compute is the time in its stages' chunks
from the schedule's clock (`hpcml.distributed.pipeline_clock`), plus the optimizer step.

On a GPU the marks are CUDA events recorded on the current stream (no host sync); they are read
(`Event.elapsed_time`, which waits for them) only at the comparison step. On the CPU the ops are
synchronous, so `time.perf_counter()` at the same marks is the compute time.

The slow rank is named with its host and device; on a GPU with `pynvml` importable, its SM clock,
the clock's maximum and the NVML clock-event (throttle) reasons are recorded too.

Hand-written: torch has no per-rank compute timer that leaves out collective waits (the
profiler records everything and costs far more than a few events per step).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpcml.distributed.parallel import wrap_dtensor_waits, wrap_fsdp_waits
from hpcml.distributed.runtime import Runtime, all_gather_object, all_gather_rows

Mark = Any
"""A torch.cuda.Event (GPU) or a perf_counter() float (CPU)."""


class StepTimer:
    """Collects this rank's compute spans; `window_s()` reads and clears them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._spans: list[tuple[Mark, Mark, list[tuple[Mark, Mark]]]] = []
        """(start, end, the waits for other ranks inside it)."""
        self._fb_start: Mark | None = None
        self._fb_end: Mark | None = None
        self._opt_start: Mark | None = None
        self._steps = 0
        self._extra_s = 0.0
        self._grad_handles: list[Any] = []
        self._last_param: int | None = None
        self._pruned = False
        self._handles: list[Any] = []
        self._waits: list[tuple[Mark, Mark]] = []  # of the open forward/backward span
        self._unwrap_fsdp: Callable[[], None] | None = None
        self._unwrap_dtensor: Callable[[], None] | None = None
        self._clock: Any = None
        """parallel.pp on the CPU: the stages' clock (hpcml.distributed.pipeline_clock)."""
        self._clock_at = 0.0
        self._clock_s = 0.0

    # -- marks -----------------------------------------------------------------------------

    def _mark(self, event: Any = None) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        if event is None:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def attach(self, model: nn.Module | None, optimizer: Any = None) -> None:
        """Hooks on every trainable parameter (pruned to the one whose gradient comes last
        after the first backward) and on the optimizer's step. Under parallel.pp a stage
        waits for its neighbours between its chunks, inside any span from a forward to a last
        gradient: on the CPU the stages' own clock times their chunks instead (on a GPU its
        host times are launches, not compute, and the spans stay)."""
        clock = getattr(model, "pipeline_clock", None)
        if clock is not None and not self.cuda:
            self._clock, self._clock_at = clock, clock.busy_s
            model = None  # no forward spans or gradient hooks; the optimizer's below
        if model is not None:
            self._unwrap_fsdp = wrap_fsdp_waits(model, self._timed_wait)
            self._unwrap_dtensor = wrap_dtensor_waits(model, self._timed_wait)
        fsdp = self._unwrap_fsdp is not None
        params = [p for p in model.parameters() if p.requires_grad] if model and not fsdp else []
        for i, p in enumerate(params):
            self._grad_handles.append(p.register_post_accumulate_grad_hook(self._grad_ready(i)))
        # Opacus's DP optimizer (privacy.dp_sgd) keeps no hooks of its own; the one it wraps steps.
        optimizer = getattr(optimizer, "original_optimizer", optimizer)
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self._handles += [
                optimizer.register_step_pre_hook(lambda *_: self.before_optimizer()),
                optimizer.register_step_post_hook(lambda *_: self.after_optimizer()),
            ]

    def close(self) -> None:
        for h in self._grad_handles + self._handles:
            h.remove()
        self._grad_handles, self._handles = [], []
        for undo in (self._unwrap_fsdp, self._unwrap_dtensor):
            if undo is not None:
                undo()
        self._unwrap_fsdp = self._unwrap_dtensor = None

    def _timed_wait(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` waits for other ranks (FSDP's collectives, DTensor's); its time inside a
        timed span is not compute."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._fb_start is None:  # evaluation, or outside the training step
                return method(*args, **kwargs)
            start = self._mark()
            try:
                return method(*args, **kwargs)
            finally:
                self._waits.append((start, self._mark()))

        return timed

    def _grad_ready(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self._fb_start is None:
                return  # a backward outside a timed training forward
            self._last_param = index
            # On a GPU the one event is re-recorded: its last recording is the last gradient.
            self._fb_end = self._mark(self._fb_end)

        return hook

    def forward_started(self) -> None:
        if self._clock is not None:
            return
        if self._unwrap_fsdp is not None:  # FSDP: one span from the first micro-batch on
            if self._fb_start is None:
                self._fb_start = self._mark()
            return
        self._close_fb()
        self._fb_start = self._mark()

    def _close_fb(self) -> None:
        if self._fb_start is not None and self._fb_end is not None:
            self._spans.append((self._fb_start, self._fb_end, self._waits))
        self._fb_start = self._fb_end = None
        self._waits = []
        if not self._pruned and self._last_param is not None:
            # The gradient order of a static graph repeats: keep only the last one's hook.
            keep = self._last_param
            for i, h in enumerate(self._grad_handles):
                if i != keep:
                    h.remove()
            self._grad_handles = [self._grad_handles[keep]]
            self._last_param = 0
            self._pruned = True

    def before_optimizer(self) -> None:
        self._close_fb()
        self._opt_start = self._mark()

    def after_optimizer(self) -> None:
        if self._opt_start is not None:
            self._spans.append((self._opt_start, self._mark(), []))
            self._opt_start = None

    def end_step(self, data_wait_s: float) -> None:
        """After the last backward of a step, before the optimizer."""
        if self._unwrap_fsdp is not None and self._fb_start is not None:
            self._fb_end = self._mark()
            self._close_fb()
        if self._clock is not None:
            busy = self._clock.busy_s
            self._clock_s, self._clock_at = self._clock_s + busy - self._clock_at, busy
        self._steps += 1
        self._extra_s += data_wait_s

    # -- reading ---------------------------------------------------------------------------

    def window_s(self) -> tuple[float, float]:
        """(mean compute seconds per step, mean data-wait seconds per step) since the last
        call; on a GPU this waits for the recorded events (the only sync)."""
        self._close_fb()
        spans, steps, extra = self._spans, max(self._steps, 1), self._extra_s
        self._spans, self._steps, self._extra_s = [], 0, 0.0
        total = sum(self._compute_s(*span) for span in spans) + self._clock_s
        self._clock_s = 0.0
        return max(total, 0.0) / steps, extra / steps

    def _compute_s(self, start: Mark, end: Mark, waits: list[tuple[Mark, Mark]]) -> float:
        """A span's length less the parts of its waits that lie inside it (a wait may run past
        the span's end: the gradient norm's all-reduce after the last gradient)."""
        if self.cuda:
            for mark in [end, *(e for _, e in waits)]:
                mark.synchronize()

        def offset(mark: Mark) -> float:  # seconds from the span's start
            return float(start.elapsed_time(mark) / 1000.0 if self.cuda else mark - start)

        length = offset(end)
        waited = sum(max(0.0, min(offset(e), length) - max(offset(s), 0.0)) for s, e in waits)
        return length - waited


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def nvml_state(device: torch.device) -> dict[str, Any] | None:
    """SM clock, its maximum, temperature, power and the clock-event (throttle) reasons of this
    rank's GPU; None without a GPU or without pynvml."""
    if device.type != "cuda":
        return None
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    try:
        from hpcml.observe.gpu_health import clock_event_mask, cuda_uuid, reason_names

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByUUID(cuda_uuid(index))
        mask = clock_event_mask(pynvml, handle)
        return {
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "clock_event_reasons": reason_names(pynvml, mask),
            "clock_event_mask": mask,
        }
    except Exception as exc:  # noqa: BLE001 - NVMLError and friends: report, never fail training
        return {"error": f"{type(exc).__name__}: {exc}"}


def compare(rt: Runtime, timer: StepTimer, factor: float, step: int) -> list[dict[str, Any]]:
    """Every rank calls this at the same step; returns one straggler record per rank slower
    than `factor` x the (lower) median of all ranks. One all-gather of three numbers and one
    host read of them; only when some rank is slow (every rank sees the same times, so all
    agree) a second gathers the slow ranks' host, device and NVML state."""
    compute_s, data_s = timer.window_s()
    mine = torch.tensor([compute_s + data_s, compute_s, data_s], dtype=torch.float64)
    rows = all_gather_rows(rt, mine.to(rt.device)).tolist()
    if rt.world_size < 2:
        return []
    times = [row[0] for row in rows]
    # median_low: with two ranks the reference is the faster one, not their mean.
    ref = statistics.median_low(times)
    slow = [rank for rank, t in enumerate(times) if ref > 0 and t > factor * ref]
    if not slow:
        return []
    where = all_gather_object(rt, _where(rt) if rt.rank in slow else None)
    out = []
    for rank in slow:
        t, rec = times[rank], where[rank]
        event = {
            "event": "straggler",
            "step": step,
            "rank": rank,
            "host": rec["host"],
            "node": rec["node"],
            "device": rec["device"],
            "local_step_s": t,
            "compute_s": rows[rank][1],
            "data_wait_s": rows[rank][2],
            "median_s": ref,
            "ratio": t / ref,
        }
        if rec["nvml"] is not None:
            event["nvml"] = rec["nvml"]
        out.append(event)
    return out


class Persistence:
    """Counts, per rank, the straggler checks in a row that named it; `update` returns the
    nodes of the ranks that reach `after` (once each run of checks)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.in_a_row: dict[int, int] = {}

    def update(self, events: list[dict[str, Any]], world_size: int) -> list[str]:
        slow = {e["rank"]: e for e in events}
        nodes = []
        for rank in range(world_size):
            self.in_a_row[rank] = self.in_a_row.get(rank, 0) + 1 if rank in slow else 0
            if self.after and self.in_a_row[rank] == self.after:
                nodes.append(str(slow[rank]["node"]))
        return nodes


def _where(rt: Runtime) -> dict[str, Any]:
    """Where this rank runs: host, SLURM node name (what `--exclude` takes; the host name
    outside SLURM), device and its NVML state."""
    host = socket.gethostname()
    return {
        "host": host,
        "node": os.environ.get("SLURMD_NODENAME") or host,
        "device": device_name(rt.device),
        "nvml": nvml_state(rt.device),
    }
