"""The optimizer update of one step: clip, step, schedule, and the device-side skip of a step
whose global gradient norm is not finite (every rank alike: the norm is reduced over all
shards, `hpcml.distributed.parallel.grad_norm`).

No path reads the decision on the host. A fused optimizer takes it as `found_inf`, as
GradScaler sets it; a tensor-parallel model that mixes DTensor and plain parameters steps its
fused kernel once per tensor kind (`aten._fused_adamw_` refuses a mixed list). An optimizer
without a fused kernel (`optim` built with fused=False) steps, then puts back the parameters
and state it held before where the norm was not finite (`torch.where`: one copy of them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
    update is dropped on every rank, on the device. Returns the lr and, with `norm`, whether
    the update was dropped (a device tensor, 1.0 if so)."""
    if grad_clip is not None:
        if norm is None:  # fp16: unscale first, the scaler skips non-finite steps itself
            scaler.unscale_(optimizer)
        clip_grad_norm(model, grad_clip, norm)
    lr = float(optimizer.param_groups[0]["lr"])
    inner: Any = getattr(optimizer, "optim", optimizer)  # ZeRO-1 wraps one
    found_inf = None
    if norm is None:
        scaler.step(optimizer)
    else:
        found_inf = (~torch.isfinite(norm)).float()
        if inner.defaults.get("fused"):
            inner.found_inf = found_inf  # read by the fused kernel, as GradScaler sets it
            with groups_by_tensor_kind(inner):
                scaler.step(optimizer)
        else:
            with restored_where(inner, found_inf):
                scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return lr, found_inf


def _kind(t: torch.Tensor) -> Any:
    """DTensors on one mesh with one layout go into one fused call; plain tensors into another."""
    return (t.device_mesh, t.placements) if isinstance(t, DTensor) else None


@contextmanager
def groups_by_tensor_kind(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """For one `step()`, split each param group whose parameters mix plain tensors and DTensors
    into one group per kind, with the same settings: torch's optimizers call their functional
    update once per group, so each fused call gets one kind. State is keyed by parameter and
    the groups' settings are only read, so nothing else changes; the groups are put back."""
    groups = optimizer.param_groups
    split: list[dict[str, Any]] = []
    for group in groups:
        kinds: dict[Any, list[torch.Tensor]] = {}
        for p in group["params"]:
            kinds.setdefault(_kind(p), []).append(p)
        split += [{**group, "params": params} for params in kinds.values()]
    if len(split) == len(groups):
        yield
        return
    optimizer.param_groups = split
    try:
        yield
    finally:
        optimizer.param_groups = groups


@contextmanager
def restored_where(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Iterator[None]:
    """Step a non-fused optimizer, then put back its parameters and tensor state where
    `found_inf` is 1, on the device (no host read). State created by this step (the first)
    is put back to zeros, which is what the optimizers start from."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    before_p = [p.detach().clone() for p in params]
    before_s = {
        id(p): {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
        for p in params
        if p in optimizer.state
    }
    yield
    with torch.no_grad():
        for p, old in zip(params, before_p, strict=True):
            p.copy_(torch.where(found_inf.to(old.device).bool(), old, p.detach()))
        for p in params:
            saved = before_s.get(id(p), {})
            for k, v in optimizer.state[p].items():
                if torch.is_tensor(v):
                    old = saved.get(k, torch.zeros_like(v))
                    v.copy_(torch.where(found_inf.to(v.device).bool(), old, v))
