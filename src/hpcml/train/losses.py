"""Training losses. One cross-entropy serves every task in the zoo: logits (..., C) against
integer targets (...), so (B, C) vs (B,) for classification and (B, T, V) vs (B, T) for
next-token prediction, averaged over every predicted position."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction
    )
