"""Wrapping a model for data parallelism. Later strategies (FSDP2, ZeRO, TP) add named
functions here, applied per model family, apart from the model code."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpcml.config import ParallelConfig
from hpcml.dist.runtime import Runtime


def apply_ddp(model: nn.Module, rt: Runtime, cfg: ParallelConfig) -> nn.Module:
    if cfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return DDP(
        model,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=True,
    )


def parallelize(model: nn.Module, rt: Runtime, cfg: ParallelConfig) -> nn.Module:
    """Return the model wrapped for `cfg.strategy`; a single process gets the model unchanged."""
    if not rt.distributed:
        return model
    if cfg.strategy == "ddp":
        return apply_ddp(model, rt, cfg)
    raise ValueError(f"unknown strategy {cfg.strategy}")  # config validation prevents this


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def no_sync(model: nn.Module, skip: bool) -> AbstractContextManager[None]:
    """Skip the gradient all-reduce on micro-batches that are not the last of an accumulation."""
    if skip and isinstance(model, DDP):
        return model.no_sync()  # type: ignore[no-any-return]
    return nullcontext()


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (its local shards)."""

    def nbytes(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", t)  # DTensor shards count what is local
        return int(local.numel() * local.element_size())

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                opt += nbytes(v)
    return {
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": opt,
        "model_states_bytes": params + grads + opt,
    }
