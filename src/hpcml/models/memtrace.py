"""The memory of one training step, traced without allocating it.

The model, its optimizer and a batch are created under torch's `FakeTensorMode` (tensors with
shapes, dtypes and devices but no storage), and one step (forward, backward, optimizer) runs
under PyTorch's own `MemTracker` (`torch.distributed._tools.mem_tracker`), a
`TorchDispatchMode` that follows every storage the step creates and frees and files it as a
parameter, buffer, gradient, optimizer state, activation (made in forward) or temporary (made
in backward), with the peak and what was alive at it. A first, untracked step creates the
optimizer's states, so the traced step is a steady one: states alive from its start.

Works for any `nn.Module` whose forward runs on fake tensors (the zoo, Hugging Face models,
a user's `module:fn`); nothing is computed, so a 70B model traces in the time its ops take to
dispatch. What it cannot see: memory that bypasses torch's dispatcher (a kernel's own
workspace, cuDNN/oneDNN scratch), and the CUDA caching allocator's fragmentation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

# MemTracker's reference types (and FSDPMemTracker's) -> the planner's categories. Inputs are
# what the step was handed (MemTracker tracks them as "Other").
_CATEGORY = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "inputs",
    "Inputs": "inputs",
    "Unsharded Param": "gathered_params",
    "Unsharded Grad": "unsharded_grads",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
}
CATEGORIES = tuple(dict.fromkeys(_CATEGORY.values()))

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TracedStep:
    """Bytes of one steady training step on one rank."""

    peak_bytes: int
    at_peak: dict[str, int]
    """What was alive at the peak, by category."""
    states: dict[str, int]
    """Alive after the step: parameters, buffers, optimizer states (and gradients, which the
    next step's zero_grad frees)."""
    activation_peak_bytes: int
    """The most activation bytes alive at once (at the end of forward, before backward frees
    them): what autograd keeps for backward plus the step's output."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "at_peak": dict(self.at_peak),
            "states": dict(self.states),
            "activation_peak_bytes": self.activation_peak_bytes,
        }


def _by_category(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for dev_snap in snapshot.values():
        for key, nbytes in dev_snap.items():
            name = key.value if isinstance(key, Enum) else str(key)
            if name in _CATEGORY:
                out[_CATEGORY[name]] += int(nbytes)
    return out


def run_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    on_forward_end: Callable[[], None] | None = None,
    on_micro_batch: Callable[[int], None] | None = None,
    keep_grads: bool = False,
) -> None:
    """One optimizer step over `batches` (the micro-batches of gradient accumulation), as
    hpcml's Trainer runs it: gradients set to None first (zeroed in place with `keep_grads`,
    as DDP's buckets keep them), the loss divided by their count."""
    optimizer.zero_grad(set_to_none=not keep_grads)
    for i, (x, y) in enumerate(batches):
        if on_micro_batch is not None:
            on_micro_batch(i)
        with autocast():
            loss = loss_fn(model(x), y) / len(batches)
        if on_forward_end is not None:
            on_forward_end()
        loss.backward()
        del loss
    optimizer.step()


@contextmanager
def fake_mode() -> Iterator[Any]:
    """torch's FakeTensorMode: every tensor made inside has metadata and no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        yield mode


def create_states(model: nn.Module, optimizer: torch.optim.Optimizer, keep_grads: bool) -> None:
    """The optimizer's states, as a first step leaves them: one optimizer step over zero
    gradients (half a trace's cost saved against a whole forward and backward first)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not keep_grads)


def trace_step(
    build: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    make_batches: Callable[[], list[Batch]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    shard: Callable[[nn.Module], None] | None = None,
    keep_grads: bool = False,
) -> TracedStep:
    """Build, warm up (the optimizer's states created untracked) and trace one step,
    all on fake tensors. `shard` applies FSDP2 to the built model (under a process group the
    caller set up, e.g. torch's fake one); the step is then traced by FSDPMemTracker, which also
    files gathered parameters and the collectives' buffers. `keep_grads`: gradients outlive
    zero_grad (DDP's buckets hold them), so the traced step starts with them alive."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with fake_mode():
        model = build()
        if shard is not None:
            shard(model)
        optimizer = make_optimizer(model)
        batches = make_batches()
        if shard is None:
            create_states(model, optimizer, keep_grads)
        else:  # FSDP2 initialises itself lazily in its first forward: a whole step first
            run_step(model, optimizer, batches, loss_fn, autocast, keep_grads=keep_grads)
            optimizer.zero_grad(set_to_none=not keep_grads)
        inputs = [t for b in batches for t in b]
        if shard is not None:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            tracker: MemTracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(tuple(inputs))  # type: ignore[attr-defined]
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, *inputs)
        acts: list[int] = []

        def note_activations() -> None:
            acts.append(_by_category(tracker.get_tracker_snapshot())["activations"])

        def next_micro_batch(i: int) -> None:
            # MemTracker refuses a second forward of the root module in one pass; its module
            # statistics (not the peak) start again for each micro-batch of an accumulation.
            if i:
                tracker.reset_mod_stats()

        with tracker:
            run_step(
                model,
                optimizer,
                batches,
                loss_fn,
                autocast,
                note_activations,
                next_micro_batch,
                keep_grads,
            )
        peak = tracker.get_tracker_snapshot("peak")
        after = _by_category(tracker.get_tracker_snapshot())
    at_peak = _by_category(peak)
    return TracedStep(
        peak_bytes=sum(int(dev_snap.get("Total", 0)) for dev_snap in peak.values()),
        at_peak=at_peak,
        states={k: after[k] for k in ("params", "buffers", "grads", "optimizer")},
        activation_peak_bytes=max(acts, default=0),
    )
