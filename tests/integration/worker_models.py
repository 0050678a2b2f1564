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


INF_STEP = 3
"""The training backward of `inf_row_gpt` that puts +Inf into one row of the head's gradient."""


class _InfRowLinear(nn.Linear):
    """The output head of `inf_row_gpt`: at its INF_STEP-th training backward, row 0 of its
    weight gradient (one vocabulary entry) becomes +Inf. Sharded by rows (FSDP's dim-0 shards,
    tensor parallelism's vocabulary split), only the rank that holds row 0 sees it: the loss
    and every other gradient stay finite."""

    backwards = 0

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        type(self).backwards += 1
        if type(self).backwards != INF_STEP:
            return grad
        from torch.distributed.tensor import DTensor

        if isinstance(grad, DTensor):  # tensor parallel: this rank's rows of the vocabulary
            local = grad.to_local().clone()
            if grad.device_mesh.get_local_rank() == 0:
                local[0] = float("inf")
            return DTensor.from_local(local, grad.device_mesh, grad.placements)
        grad = grad.clone()
        grad[0] = float("inf")
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.training and torch.is_grad_enabled():
            weight = weight.view_as(weight)
            weight.register_hook(self._poison)
        return torch.nn.functional.linear(x, weight, self.bias)


def inf_row_gpt(**kwargs: object) -> nn.Module:
    """gpt-tiny whose head gradient gets one Inf row at the INF_STEP-th training step."""
    from hpcml.models.gpt import build_gpt

    args = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 64}
    model = build_gpt(**{**args, **kwargs})
    head = _InfRowLinear(model.cfg.d_model, model.cfg.padded_vocab, bias=False)
    head.weight = model.lm_head.weight  # tied to the token table, as gpt-tiny's head is
    model.lm_head = head
    return model


inf_row_gpt.input_shape = (64,)  # type: ignore[attr-defined]
