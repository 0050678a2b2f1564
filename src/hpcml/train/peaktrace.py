"""The peak of one real training step on this rank, from allocation tracing.

CUDA's caching allocator counts its own peak; on the CPU nothing does, so one step (every
micro-batch's forward and backward, then the optimizer step) runs under a `TorchDispatchMode`
that follows allocations: every storage an operator creates (an output its schema does not
declare an alias of an input) is counted from the moment it appears until it is freed (a
weakref callback when its storage dies), and the storages alive when the step begins
(parameters, gradients, buffers, optimizer states) count from the start until freed, so the
previous step's gradients leave the count when zero_grad drops them. FSDP2 allocates and frees
its gathered parameters with `UntypedStorage.resize_`, which no dispatch mode sees: resizes are
followed while tracing (as torch's MemTracker does). A gradient storage no operator created
and that was not alive at the start (DDP's buckets, allocated at wrap time, hold the
gradients as views) existed throughout the step: it is added to the peak at the end.

The peak is the most bytes alive at once, with what was alive then by kind (the state kinds
held at the start, and what forward, backward and the optimizer step created). Hand-written
rather than torch's MemTracker, which the planner's prediction uses (`hpcml.models.memtrace`):
a measurement with the predictor's own tool would share its blind spots. Not seen: memory
below the dispatcher (oneDNN scratch, gloo's own buffers) and tensors made on other threads.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS = ("params", "grads", "buffers", "optimizer", "forward", "backward", "optimizer_step")


def _fresh_outputs(func: Any) -> bool | None:
    """Whether the operator's outputs are new storages (no return aliases an input, by its
    schema); None when it has no schema (then a storage not seen before counts as new)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    return all(r.alias_info is None for r in schema.returns)


class LiveBytes(TorchDispatchMode):
    """Live storage bytes and their peak while active, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[str, int]] = {}  # storage identity -> (kind, bytes)
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = dict(self.by_kind)
        self.in_optimizer = 0  # optimizer steps running (ZeroRedundancyOptimizer nests one)
        self.failed: str | None = None
        """why counting stopped (an operator's output it could not read), or None"""
        self._undo: list[Any] = []

    # --- the count -------------------------------------------------------------------------

    def add(self, st: torch.UntypedStorage, kind: str) -> None:
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        self.live[key] = (kind, nbytes)
        self.by_kind[kind] += nbytes
        self.total += nbytes
        self._refs[key] = weakref.ref(st, functools.partial(self._on_death, key))

    def _on_death(self, key: int, _ref: Any) -> None:
        self._freed(key)

    def _freed(self, key: int) -> None:
        self._refs.pop(key, None)
        entry = self.live.pop(key, None)
        if entry is not None:
            self.by_kind[entry[0]] -= entry[1]
            self.total -= entry[1]

    def phase(self) -> str:
        """What is creating storages now: backward (autograd's engine is running a node:
        recomputation of checkpointed activations included), the optimizer step, or else
        `forward` (the loss and gradient clipping too)."""
        if self.in_optimizer:
            return "optimizer_step"
        return "forward" if torch._C._current_autograd_node() is None else "backward"

    def _resized(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key not in self.live:
            self.add(st, self.phase())
        else:
            kind, old = self.live[key]
            new = st.nbytes()
            self.live[key] = (kind, new)
            self.by_kind[kind] += new - old
            self.total += new - old
        self.note_peak()

    def note_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = dict(self.by_kind)

    def forget(self) -> None:
        """Stop following the storages (their weak references go, with their callbacks)."""
        self._refs.clear()
        self.live.clear()

    def add_tensor(self, t: Any, kind: str) -> None:
        if isinstance(t, torch.Tensor):
            for st in get_untyped_storages(t):
                self.add(st, kind)

    # --- the mode --------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which are seen
        out = func(*args, **(kwargs or {}))
        if self.failed is None:
            try:
                self._count(func, out)
            except Exception as exc:  # a measurement must never fail the step it measures
                self.failed = f"{type(exc).__name__}: {exc}"[:200]
        return out

    def _count(self, func: Any, out: Any) -> None:
        fresh = _fresh_outputs(func)
        if fresh is False:
            return
        kind = self.phase()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    if fresh or st._cdata not in self.live:
                        self.add(st, kind)
        self.note_peak()

    def __enter__(self) -> LiveBytes:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        orig, tracer = torch.UntypedStorage.resize_, self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            if tracer.failed is None:
                try:
                    tracer._resized(st)
                except Exception as exc:  # as in __torch_dispatch__
                    tracer.failed = f"{type(exc).__name__}: {exc}"[:200]
            return out

        def optimizing(change: int) -> Any:
            def hook(*_: Any) -> None:
                tracer.in_optimizer += change

            return hook

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self._undo = [
            lambda: setattr(torch.UntypedStorage, "resize_", orig),
            register_optimizer_step_pre_hook(optimizing(1)).remove,
            register_optimizer_step_post_hook(optimizing(-1)).remove,
        ]
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        for undo in self._undo:
            undo()
        self._undo = []


class StepPeak:
    """Traces one step of the Trainer's loop on the CPU: the third this process runs (steady:
    its optimizer states exist from its start, and DDP rebuilt its buckets in the second),
    or its last when it runs fewer; `result()` is the summary's memory fields for this rank.
    Steps up to the third are warm-up to the step-time median (StepMeter.throughput)."""

    def __init__(self, model: nn.Module, optimizer: Any, last: int, enabled: bool) -> None:
        self.model, self.optimizer = model, optimizer
        self.last = last
        self.when: int | None = None
        self.enabled = enabled
        self.tracer: LiveBytes | None = None
        self.traced_step: int | None = None
        self.cpu_s = 0.0

    def _baseline(self, tracer: LiveBytes) -> None:
        for p in self.model.parameters():
            tracer.add_tensor(p, "params")
            tracer.add_tensor(p.grad, "grads")
        for b in self.model.buffers():
            tracer.add_tensor(b, "buffers")
        held = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer's own
        for state in held.state.values():
            for v in state.values():
                tracer.add_tensor(v, "optimizer")
        tracer.note_peak()

    def _untraced_grads(self, tracer: LiveBytes) -> None:
        """Gradient storages no operator made and not alive at the start (DDP's buckets):
        alive through the whole step, so they add to the peak as they add to the count."""
        extra = 0
        for p in self.model.parameters():
            if p.grad is None:
                continue
            for st in get_untyped_storages(p.grad):
                if st._cdata not in tracer.live:
                    tracer.add(st, "grads")
                    extra += st.nbytes()
        if extra:
            tracer.peak += extra
            tracer.at_peak["grads"] += extra

    @contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Wraps the Trainer's whole step `number` (forward, backward, optimizer)."""
        if self.when is None:
            self.when = min(number + 2, self.last)
        if not self.enabled or number != self.when:
            yield
            return
        t0 = time.process_time()
        tracer = LiveBytes()
        self._baseline(tracer)
        with tracer:
            yield
        self._untraced_grads(tracer)
        tracer.forget()
        self.tracer, self.traced_step = tracer, number
        self.cpu_s = time.process_time() - t0

    def result(self) -> dict[str, Any]:
        if self.tracer is None:
            return {"traced_peak_bytes": None}
        if self.tracer.failed is not None:
            return {"traced_peak_bytes": None, "traced_peak_error": self.tracer.failed}
        return {
            "traced_peak_bytes": int(self.tracer.peak),
            "traced_peak_step": self.traced_step,
            "traced_at_peak": {k: int(v) for k, v in self.tracer.at_peak.items()},
            "traced_peak_cpu_s": round(self.cpu_s, 4),
        }
