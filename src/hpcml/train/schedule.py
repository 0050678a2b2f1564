"""Learning-rate schedule: linear warmup then cosine / linear decay or constant."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hpcml.config import OptimConfig

_NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the base LR after `step` optimizer steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    horizon = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / horizon)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_horizon(cfg: OptimConfig, max_steps: int) -> int:
    """Steps over which the LR decays: optim.decay_steps, else train.max_steps. Checkpoints
    store it, so a resume with another max_steps does not silently bend the schedule."""
    return cfg.decay_steps or max_steps


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    total = lr_horizon(cfg, max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total))


def can_fuse(params: list[Any]) -> bool:
    """Whether torch has a fused kernel for every parameter's device (and it is floating
    point). A tensor-parallel model that mixes plain tensors and DTensors steps fused too:
    `hpcml.train.update` calls the kernel once per tensor kind."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    flat = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return all(t.device.type in devices and torch.is_floating_point(t) for t in flat)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[Any]:
    """The trainable parameters of `model` for the optimizer. With weight decay on and
    optim.decay_norms_biases_embeddings false: two groups, the second (norm and embedding
    parameters, biases, any parameter of fewer than 2 dims) with weight_decay 0. Otherwise one
    plain list (so checkpoints of runs without decay keep their single group). Modules are
    recognised through FSDP2's and DDP's wrappers (FSDP2 subclasses them; DDP holds them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.weight_decay == 0 or cfg.decay_norms_biases_embeddings:
        return params
    exempt: set[int] = set()
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if isinstance(m, _NO_DECAY_MODULES) or name == "bias" or p.ndim < 2:
                exempt.add(id(p))
    decay = [p for p in params if id(p) not in exempt]
    no_decay = [p for p in params if id(p) in exempt]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(
    params: Iterable[Any], cfg: OptimConfig, world_size: int, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW or SGD with the fused kernel where the parameters allow it (one kernel per step,
    and a step the Trainer can skip on the device through `found_inf`, as GradScaler does).
    Without it AdamW keeps its step counts on the parameters' device (`capturable`, off the
    CPU), so that the Trainer's skip of a non-finite step needs no host read either."""
    params = list(params)
    fused = can_fuse(params) if fused is None else fused
    on_device = not fused and _off_cpu(params)
    lr = cfg.lr * (world_size if cfg.scale_lr_with_world else 1)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            fused=fused,
        )
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused,
        capturable=on_device,
    )


def _off_cpu(params: list[Any]) -> bool:
    flat = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return any(t.device.type not in ("cpu", "meta") for t in flat)
