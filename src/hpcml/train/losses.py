"""Training losses. One cross-entropy serves every task in the zoo: logits (..., C) against
integer targets (...), so (B, C) vs (B,) for classification and (B, T, V) vs (B, T) for
next-token prediction, averaged over every predicted position; or against class probabilities
of the logits' shape (mixup / cutmix's mixed targets, `data.mixup_alpha`), which a custom loss
then also receives.

`train.loss` picks the loss: `cross_entropy` or an import path `pkg.mod:fn` to a callable
`fn(logits, target) -> scalar tensor` (a mean over the micro-batch). The user opts in by
naming it; nothing is imported from data files.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hpcml.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    classes = logits.shape[-1]
    if target.is_floating_point():  # class probabilities (B, C), e.g. mixup's mixed targets
        return F.cross_entropy(
            logits.reshape(-1, classes), target.reshape(-1, classes), reduction=reduction
        )
    return F.cross_entropy(logits.reshape(-1, classes), target.reshape(-1), reduction=reduction)


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy}


def resolve_loss(name: str) -> LossFn:
    """A loss by name (`cross_entropy`) or import path (`pkg.mod:fn`)."""
    if name in LOSSES:
        return LOSSES[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"train.loss '{name}' is neither a known loss ({', '.join(LOSSES)}) nor an import "
            "path like mypkg.losses:my_loss; fix train.loss."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"train.loss '{name}': module '{module_name}' cannot be imported ({exc}); check "
            "the name and that the package is on PYTHONPATH."
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(
            f"train.loss '{name}': module '{module_name}' has no callable '{attr}'; point "
            "train.loss at a function fn(logits, target) -> loss."
        )
    return fn  # type: ignore[no-any-return]
