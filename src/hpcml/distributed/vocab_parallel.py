"""Scores of vocabulary-sharded logits without gathering them: evaluation under loss-parallel
tensor parallelism, whose logits (a DTensor, Shard(-1) over the tensor-parallel mesh) would
be (batch, positions, vocabulary) floats on every rank once gathered.

Three all-reduces of one number per position (the row maximum, the sum of exponentials, the
target's logit), as Megatron-LM's vocabulary-parallel cross-entropy does. Hand-written because
torch's `loss_parallel()` gives the loss only, and the accuracy (is the target the arg-max?)
needs the same row maximum.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def vocab_sharded(logits: DTensor) -> bool:
    """Whether `logits` are sharded by vocabulary on a 1-D mesh (what tensor parallelism's
    loss-parallel head gives), the layout `vocab_parallel_scores` takes."""
    first = logits.placements[0]
    return (
        logits.device_mesh.ndim == 1
        and isinstance(first, Shard)
        and first.dim in (-1, logits.dim() - 1)
    )


@torch.no_grad()
def vocab_parallel_scores(
    logits: DTensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position cross-entropy (float32) and whether the target's logit is the row's
    maximum (bool), both of `target`'s shape, from `logits` (..., vocab) sharded by vocabulary
    on a 1-D mesh. Equal to `F.cross_entropy(full, target, reduction="none")` and
    `full.argmax(-1) == target` on the gathered logits up to float rounding (and ties)."""
    mesh = logits.device_mesh
    if not vocab_sharded(logits):
        raise ValueError(f"logits not sharded by vocabulary on one mesh axis: {logits.placements}")
    group = mesh.get_group()
    local = logits.to_local().float()
    # Shard splits like torch.chunk: every rank but the last holds ceil(vocab / size) columns.
    offset = mesh.get_local_rank() * math.ceil(logits.shape[-1] / mesh.size())
    row_max = local.amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (local - row_max.unsqueeze(-1)).exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    index = target - offset
    here = (index >= 0) & (index < local.shape[-1])
    picked = local.gather(-1, index.clamp(0, max(local.shape[-1] - 1, 0)).unsqueeze(-1))
    target_logit = torch.where(here, picked.squeeze(-1), 0.0)
    dist.all_reduce(target_logit, group=group)
    loss = row_max + sum_exp.log() - target_logit
    return loss, target_logit >= row_max
