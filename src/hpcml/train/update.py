"""The optimizer update of one step: clip, step, schedule, and the device-side skip of a step
whose global gradient norm is not finite (every rank alike: the norm is reduced over all
shards, `hpcml.distributed.parallel.grad_norm`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpcml.distributed.parallel import clip_grad_norm


def optimizer_step(
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    grad_clip: float | None,
    norm: torch.Tensor | None = None,
) -> tuple[float, torch.Tensor | None]:
    """Clip, step, schedule. `norm` is the global gradient norm; when it is not finite the
    update is dropped on every rank: inside the fused optimizer (`found_inf`, as GradScaler
    sets it: no host sync), else by one host sync. Returns the lr and, with `norm`, whether the
    update was dropped (a device tensor, 1.0 if so)."""
    if grad_clip is not None:
        if norm is None:  # fp16: unscale first, the scaler skips non-finite steps itself
            scaler.unscale_(optimizer)
        clip_grad_norm(model, grad_clip, norm)
    lr = float(optimizer.param_groups[0]["lr"])
    inner: Any = getattr(optimizer, "optim", optimizer)  # ZeRO-1 wraps one
    found_inf = None
    if norm is not None:
        found_inf = (~torch.isfinite(norm)).float()
        if inner.defaults.get("fused"):
            inner.found_inf = found_inf  # read by the fused kernel, as GradScaler sets it
        elif found_inf.item():  # an optimizer without a fused kernel: one sync per step
            scheduler.step()
            return lr, found_inf
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return lr, found_inf
