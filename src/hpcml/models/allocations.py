"""The peak of real CPU allocations over a piece of work, from the allocator's own reports.

c10's CPU allocator reports every allocation and free to torch's profiler when it runs with
`profile_memory=True`, each with its size and the allocator's running total; that total, in
time order, peaks where the work held the most memory beyond what was alive when it started. This is how `plan memory --trace` is checked: it reads the allocator, not the
dispatcher the tracer (`hpcml.models.memtrace`, torch's MemTracker over fake tensors) listens to,
runs on real tensors, and so also sees allocations that never pass a `TorchDispatchMode` (a
kernel's own buffers through c10) and every tensor at the size it really got.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def peak_rise_bytes(work: Callable[[], Any]) -> int:
    """Run `work` and return the most bytes its allocations held at once beyond the start."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    # Every allocation and free the allocator reported, with its running total: the raw
    # records under the profiler's event tree (what torch.profiler._memory_profiler reads;
    # the `[memory]` rows of prof.events() keep only those made outside an operator).
    found: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            fields = node.typed[1]
            found.append((node.start_time_ns, int(fields.alloc_size), int(fields.total_allocated)))
        stack.extend(node.children)
    if not found:
        raise RuntimeError("the profiler recorded no allocations")
    found.sort(key=lambda e: e[0])
    start = found[0][2] - found[0][1]  # the allocator's total before the first event
    return max(0, max(total for _, _, total in found) - start)


def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared storages once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer states: what a step starts with."""
    out = [*model.parameters(), *model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def measure_step_peak_bytes(
    build: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    make_batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    keep_grads: bool = False,
) -> int:
    """The peak of one steady training step on real CPU tensors: what the step starts with
    (states and inputs, counted by storage) plus the allocator's peak rise during it. The
    same warm-up as the tracer (`hpcml.models.memtrace.trace_step`): one step first, so the
    optimizer's states exist; `keep_grads` as there (gradients zeroed in place, as DDP's
    buckets keep them)."""
    from hpcml.models.memtrace import run_step

    model = build()
    optimizer = make_optimizer(model)
    batches = make_batches()
    run_step(model, optimizer, batches, loss_fn, autocast, keep_grads=keep_grads)
    optimizer.zero_grad(set_to_none=not keep_grads)
    start = live_bytes([*state_tensors(model, optimizer), *[t for b in batches for t in b]])
    return start + peak_rise_bytes(
        lambda: run_step(model, optimizer, batches, loss_fn, autocast, keep_grads=keep_grads)
    )
