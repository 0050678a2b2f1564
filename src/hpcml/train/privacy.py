"""Differential privacy of training (`privacy.dp_sgd`): DP-SGD with Opacus on 1 or N processes.

Opacus's `GradSampleModule` hooks every trainable layer of the model to keep each sample's
gradient; the model itself stays what the Trainer trains (its checkpoint keys and its export
are those of a run without privacy), and it is not wrapped in DDP, whose all-reduce of the
unclipped gradients would be wasted. Opacus's `DPOptimizer` clips each sample's gradient to
`max_grad_norm`, adds Gaussian noise (`noise_multiplier` x `max_grad_norm`) to their sum and
averages; over N processes `DistributedDPOptimizer` adds the noise on rank 0 only and
all-reduces the noisy sums, which equals one process drawing the whole global batch.

Opacus's RDP accountant counts one step at a sampling rate of global batch / training samples
per optimizer step; the privacy spent so far (`epsilon` at `delta`) is in every step record
(run.jsonl, MLflow) and in summary.json's `privacy` block, and its history is in each
checkpoint so a resumed run counts on. Batches are the loader's shuffled fixed-size ones, not
Poisson-sampled: the accountant's epsilon assumes Poisson sampling at that rate (the usual
approximation, Opacus's own with `poisson_sampling=False`), which the summary says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcml.config import RunConfig
from hpcml.errors import ConfigError

SAMPLING = (
    "shuffled fixed-size batches; the RDP accountant's epsilon assumes Poisson sampling at "
    "the same rate"
)


def _refusal(cfg: RunConfig, grad_accum: int) -> str | None:
    p, t, d = cfg.parallel, cfg.train, cfg.data
    checks = [
        (p.strategy != "ddp", f"parallel.strategy={p.strategy}", "data parallel (ddp) only"),
        (p.tp > 1 or p.pp > 1, f"parallel.tp={p.tp}, parallel.pp={p.pp}", "tp 1 and pp 1"),
        (cfg.precision in ("bf16", "fp16"), f"precision={cfg.precision}", "fp32 or tf32"),
        (grad_accum > 1, f"{grad_accum} micro-batches per step", "one micro-batch per step"),
        (cfg.optim.grad_clip is not None, "optim.grad_clip", "per-sample clipping instead"),
        (t.compile, "train.compile=true", "an uncompiled model"),
        (t.activation_checkpointing != "none", "train.activation_checkpointing", "none of it"),
        (cfg.finetune.method != "full", f"finetune.method={cfg.finetune.method}", "full"),
        (d.mixup_alpha > 0 or d.cutmix_alpha > 0, "mixup or cutmix", "one sample per example"),
    ]
    for bad, what, needs in checks:
        if bad:
            return f"{what} ({needs})"
    return None


def check(cfg: RunConfig, model: nn.Module, grad_accum: int) -> None:
    """Refuse, in one sentence, a run Opacus cannot train privately (before any worker starts:
    `hpcml.train.validate.resolve` calls this in the launcher too). `model` may be on meta."""
    dp = cfg.privacy.dp_sgd
    if dp is None:
        return
    problem = _refusal(cfg, grad_accum)
    if problem is not None:
        raise ConfigError(
            f"privacy.dp_sgd cannot train this run: it has {problem}; change that setting or "
            "drop privacy.dp_sgd."
        )
    try:
        from opacus.validators import ModuleValidator
    except ImportError:
        raise ConfigError(
            "privacy.dp_sgd needs Opacus; pip install 'hpcml[privacy]' (opacus)."
        ) from None
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        first = " ".join(str(errors[0]).split())[:200]
        raise ConfigError(
            f"privacy.dp_sgd: Opacus cannot compute per-sample gradients of model "
            f"{cfg.model.name} ({first}); choose a model without it (e.g. model.name=mlp)."
        )


@dataclass
class Privacy:
    """The accountant of one run and the settings its epsilon depends on."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    sample_rate: float
    target_epsilon: float | None
    accountant: Any
    hooks: Any = field(repr=False)
    """The GradSampleModule whose hooks record per-sample gradients (kept alive here)."""

    def step(self) -> dict[str, float]:
        """Count one optimizer step; the privacy spent so far, for the step record."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        return {"epsilon": self.epsilon()}

    def epsilon(self) -> float:
        if not self.accountant.history:
            return 0.0
        return float(self.accountant.get_epsilon(self.delta))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the accountant's history of (noise, rate, steps)."""
        return {"history": [list(h) for h in self.accountant.history]}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Take a checkpoint's history unless more steps are counted already (a rollback
        repeats steps whose noisy updates were computed: they stay counted)."""
        if not saved:
            return
        history = [tuple(h) for h in saved.get("history", [])]
        if sum(h[2] for h in history) > sum(h[2] for h in self.accountant.history):
            self.accountant.history = history

    def summary(self, steps: int) -> dict[str, Any]:
        return {
            "mechanism": "dp_sgd (Opacus, RDP accountant)",
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "sample_rate": self.sample_rate,
            "steps": steps,
            "sampling": SAMPLING,
        }


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    per_rank_batch: int,
    world_size: int,
    train_samples: int,
) -> tuple[torch.optim.Optimizer, Privacy | None]:
    """Hook `model` for per-sample gradients and wrap `optimizer` in Opacus's DP optimizer;
    (optimizer, None) unchanged without `privacy.dp_sgd`. Call before the LR schedule is built."""
    dp = cfg.privacy.dp_sgd
    if dp is None:
        return optimizer, None
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.optimizers import DistributedDPOptimizer, DPOptimizer

    if world_size > 1:  # rank 0's weights everywhere, as DDP's constructor would broadcast
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
    sample_rate = min(1.0, per_rank_batch * world_size / max(1, train_samples))
    sigma = dp.noise_multiplier
    if sigma is None:
        assert dp.target_epsilon is not None  # the config's validator
        sigma = noise_for(dp.target_epsilon, dp.delta, sample_rate, cfg.train.max_steps)
    for m in model.modules():  # Opacus's backward hooks forbid in-place ops on their outputs
        if getattr(m, "inplace", False) is True:  # ReLU(inplace=True): same values, a copy
            setattr(m, "inplace", False)  # noqa: B010 - nn.Module typing hides the flag
    hooks = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    wrapper = DistributedDPOptimizer if world_size > 1 else DPOptimizer
    private = wrapper(
        optimizer,
        noise_multiplier=sigma,
        max_grad_norm=dp.max_grad_norm,
        expected_batch_size=per_rank_batch,
        loss_reduction="mean",
    )
    privacy = Privacy(
        sigma, dp.max_grad_norm, dp.delta, sample_rate, dp.target_epsilon, RDPAccountant(), hooks
    )
    return private, privacy


def noise_for(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier that keeps `steps` steps within `target_epsilon`."""
    from opacus.accountants.utils import get_noise_multiplier

    try:
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant="rdp",
            )
        )
    except (ValueError, OverflowError, ZeroDivisionError) as exc:
        raise ConfigError(
            f"privacy.dp_sgd.target_epsilon {target_epsilon:g} at delta {delta:g} over {steps} "
            f"steps at sampling rate {sample_rate:.3g} cannot be met ({exc}); raise the target "
            "or give noise_multiplier."
        ) from None


def state_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state a checkpoint holds: the one Opacus's DP optimizer wraps
    (its own `step` would need per-sample gradients, which DCP's state set-up does not make)."""
    return getattr(optimizer, "original_optimizer", optimizer)
