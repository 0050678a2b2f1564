"""Validation: loss and accuracy over the whole validation set, each data-parallel rank on its
share, sums reduced once at the end.

Every rank runs the same number of batches (FSDP and TP forwards are collectives: a rank with
one batch fewer would leave its peers waiting in an all-gather forever). `shard_for_eval` pads
the shorter shares with masked samples; masked samples count for nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hpcml.distributed.runtime import Runtime, all_reduce_sum
from hpcml.distributed.vocab_parallel import vocab_parallel_scores, vocab_sharded


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    loader: Any,
    rt: Runtime,
    precision: Any,
    channels_last: bool,
    normalize: Any = None,
    forward: Any = None,
) -> dict[str, float]:
    """`normalize`: the source's normalization left to the device (uint8 pixels in).
    `forward`: the logits of a batch instead of `model(x)`; under pipeline parallelism they
    exist on the last stage only (None elsewhere: those ranks add nothing to the sums)."""
    was_training = model.training
    model.eval()
    # loss, correct, positions (a token model scores each position), samples, batches
    totals = torch.zeros(5, dtype=torch.float64, device=rt.device)
    for x, y, valid in loader:
        x = x.to(rt.device, non_blocking=True)
        if normalize is not None:
            x = normalize(x)
        y = y.to(rt.device, non_blocking=True)
        valid = valid.to(rt.device, non_blocking=True)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with precision.autocast():
            logits = model(x) if forward is None else forward(x)
        if logits is None:
            continue
        if isinstance(logits, DTensor) and vocab_sharded(logits):  # loss-parallel TP
            per_pos, correct = vocab_parallel_scores(logits, y)  # no gather
        else:
            if isinstance(logits, DTensor):  # another layout: gathered
                logits = logits.full_tensor()
            per_pos = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
            ).reshape(y.shape)
            correct = logits.argmax(dim=-1) == y
        mask = valid.reshape(-1, *([1] * (y.dim() - 1))).expand_as(y).double()
        totals[0] += (per_pos.double() * mask).sum()
        totals[1] += (correct.double() * mask).sum()
        totals[2] += mask.sum()
        totals[3] += valid.double().sum()
        totals[4] += 1
    all_reduce_sum(rt, totals)
    totals /= rt.tp  # the ranks of one tensor-parallel group evaluate the same samples
    model.train(was_training)
    values = totals.tolist()  # the one host sync of an evaluation
    n = max(values[2], 1.0)
    return {
        "val_loss": values[0] / n,
        "val_accuracy": values[1] / n,
        "val_samples": int(values[3]),
        "val_batches_per_rank": int(round(values[4] / rt.dp_size)),
    }
