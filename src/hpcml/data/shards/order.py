"""The order of an epoch over a shard set, mixing a bounded number of shards at a time.

Why: one permutation over every sample (DistributedSampler's) makes any batch need any shard;
a reading process holds only `data.shard_cache` shards, so a set in a bucket is downloaded
again and again within an epoch (issue 30: 246 GETs for 10 steps of a 40-shard set). As
Mosaic Streaming, LitData and WebDataset do, the order here shuffles the shard order, then the
samples within each run of `window` consecutive shards (a bounded shuffle buffer of shards),
so a reader needs `window` shards at once and each shard once per epoch.

The order is a function of (seed, epoch) alone, like DistributedSampler's permutation, so the
elastic guarantee of `hpcml.data.loader` holds unchanged: rank r of W takes every W-th position
of it, a checkpoint stores the global position, and a resume on another world size continues
at the next unseen position (each sample once per epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch


def shard_window_order(counts: Sequence[int], window: int, seed: int, epoch: int) -> np.ndarray:
    """Sample indices of one epoch: the shards (of `counts` samples each, in file order) in a
    random order, then the samples of each run of `window` of them shuffled together."""
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2**63, epoch]))
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    shard_order = rng.permutation(len(counts))
    parts = []
    for w in range(0, len(shard_order), window):
        run = shard_order[w : w + window]
        idx = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in run])
        rng.shuffle(idx)
        parts.append(idx)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class OrderSampler(torch.utils.data.Sampler[int]):
    """DistributedSampler's contract (`set_epoch`; rank r of W takes positions r, r+W, ...; the
    tail that does not fill a row of W is dropped) over the order `order_of(epoch)` gives."""

    def __init__(self, order_of: Callable[[int], np.ndarray], n: int, rank: int, world: int):
        self.order_of, self.n, self.rank, self.world = order_of, n, rank, world
        self.epoch = 0
        self._cached: tuple[int, np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.order_of(epoch))
        return self._cached[1]

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Iterator[int]:
        usable = self.n // self.world * self.world
        return iter(self.order(self.epoch)[self.rank : usable : self.world].tolist())
