"""ZeRO-1 as torch's ZeroRedundancyOptimizer shards it: whole parameter tensors per rank.

The ZeRO paper (and DeepSpeed, Megatron-LM's distributed optimizer) partition the optimizer
state by *elements*, so each of N ranks holds 1/N of it. torch's ZeroRedundancyOptimizer,
which hpcml's `zero1` uses, gives each rank whole parameter tensors instead: per parameter
group, largest tensor first, each tensor goes to the rank holding the fewest elements so far
(`ZeroRedundancyOptimizer._partition_parameters`, torch 2.x). For a small model one tensor can
be most of the model (the zoo MLP's first layer is 92% of it), so the busiest rank holds far
more than 1/N: plan check measured 0.54x of the optimizer state on mlp and 0.59x on simple_cnn
while predicting by elements.

The greedy assignment is restated here (a dozen lines) because plan imports no torch; the
tests check it against torch's own partition of the zoo models.
"""

from __future__ import annotations

from collections.abc import Sequence


def tensor_partition(groups: Sequence[Sequence[int]], ranks: int) -> list[tuple[int, int]]:
    """(elements, tensors) each rank holds when `groups` (element counts of each parameter
    tensor, one sequence per optimizer parameter group) are partitioned as torch's
    ZeroRedundancyOptimizer does. Sizes carry over from one group to the next."""
    elements = [0] * ranks
    tensors = [0] * ranks
    for group in groups:
        # sorted() is stable, as torch's is; ties go to the lowest rank (its _get_min_index).
        for numel in sorted(group, reverse=True):
            rank = elements.index(min(elements))
            elements[rank] += int(numel)
            tensors[rank] += 1
    return list(zip(elements, tensors, strict=True))


def busiest_rank_optimizer_bytes(
    groups: Sequence[Sequence[int]],
    ranks: int,
    bytes_per_param: float,
    bytes_per_tensor: float,
) -> tuple[float, int]:
    """Optimizer-state bytes on the rank that holds the most, and that rank's element count.

    `bytes_per_tensor`: state kept once per tensor (torch's Adam/AdamW `step`, 4 bytes)."""
    best = (-1.0, 0)
    for elements, tensors in tensor_partition(groups, ranks):
        held = elements * bytes_per_param + tensors * bytes_per_tensor
        if held > best[0]:
            best = (held, elements)
    return best
