"""User models for the worker-error tests (importable by torchrun workers through PYTHONPATH)."""

from __future__ import annotations

import os

import torch
from torch import nn

from hpcml.errors import ModelError


def fails_on_rank1(num_classes: int = 10, input_shape: list[int] | None = None) -> nn.Module:
    """A model whose builder refuses on rank 1 only: the sentence exists on that rank alone."""
    if os.environ.get("RANK") == "1":
        raise ModelError("model builder refused on rank 1 (test model fails_on_rank1).")
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))


def doubled_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user loss for `train.loss`: twice the cross-entropy (exact in floating point)."""
    return 2.0 * torch.nn.functional.cross_entropy(logits, target)
