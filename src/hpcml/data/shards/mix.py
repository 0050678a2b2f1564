"""`data.mix`: several shard sets read as one, each in proportion to its weight.

An epoch has as many samples as the sets together (N). Set i contributes n_i of them, N times
its share of the weights (largest remainders break the rounding): its own epoch order (its
shuffle window, one permutation or file order, as for a set read alone) from position 0,
repeated with the next pass's order when n_i is larger than the set. The sets' streams are then
interleaved by a seeded draw (a shuffled list of n_i labels i), which keeps each stream's own
order, so a set in a bucket is still read a window of shards at a time. Everything is a
function of (seed, epoch), so `hpcml.data.loader` resumes a mix on any world size or worker
count exactly as it resumes one set (`OrderSampler`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from hpcml.config import DataConfig
from hpcml.data.shards.loading import check_shards, load_shard_source
from hpcml.data.splits import Splits
from hpcml.errors import DataError


class MixedSet(Dataset[Any]):
    """The concatenation of `parts` (index i of part k is `starts[k] + i`), whose epoch order
    draws from each part by `weights`."""

    has_epoch_order = True
    order_always = True
    """Unshuffled (data.shuffle false) the sets are still drawn by weight, in file order."""

    def __init__(self, parts: list[Any], weights: list[float], shuffle: bool) -> None:
        self.parts, self.shuffle = parts, shuffle
        self.sizes = [len(p) for p in parts]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])[:-1].tolist()
        self.length = int(sum(self.sizes))
        self.draws = _shares(self.length, weights)

    def __len__(self) -> int:
        return self.length

    def _part_order(self, k: int, seed: int, epoch: int, passes: int) -> np.ndarray:
        part, n = self.parts[k], self.sizes[k]
        orders = []
        for p in range(passes):  # pass p of part k: an epoch number of its own
            e = epoch * passes + p
            if not self.shuffle:
                orders.append(np.arange(n))
            elif getattr(part, "has_epoch_order", False):
                orders.append(part.epoch_order(seed + 7919 * (k + 1), e))
            else:
                rng = np.random.default_rng(np.random.SeedSequence([seed % 2**63, k, e]))
                orders.append(rng.permutation(n))
        return np.concatenate(orders)

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        streams = []
        for k, n_k in enumerate(self.draws):
            passes = -(-n_k // self.sizes[k])  # a part drawn more than its size repeats
            # A part drawn less than its size: the start of its order, another each epoch.
            order = self._part_order(k, seed, epoch, max(passes, 1))
            streams.append(self.starts[k] + order[:n_k])
        rng = np.random.default_rng(np.random.SeedSequence([seed % 2**63, epoch, 104729]))
        labels = rng.permutation(np.repeat(np.arange(len(self.parts)), self.draws))
        out = np.empty(self.length, dtype=np.int64)
        for k, stream in enumerate(streams):
            out[labels == k] = stream  # positions of label k, in order: the stream's order
        return out

    def _locate(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - self.starts[k]

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        if not 0 <= i < self.length:
            raise IndexError(i)
        k, j = self._locate(i)
        return self.parts[k][j]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """Each part's samples of the batch read through its own batch path (shard by shard)."""
        by_part: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices):
            if not 0 <= int(i) < self.length:
                raise IndexError(i)
            k, j = self._locate(int(i))
            by_part.setdefault(k, []).append((pos, j))
        out: list[Any] = [None] * len(indices)
        for k, items in by_part.items():
            part = self.parts[k]
            many = getattr(part, "__getitems__", None)
            got = many([j for _, j in items]) if many else [part[j] for _, j in items]
            for (pos, _), item in zip(items, got, strict=True):
                out[pos] = item
        return out


def _shares(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`, the rounding given to the largest remainders."""
    exact = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    shares = np.floor(exact).astype(np.int64)
    for k in np.argsort(-(exact - shares), kind="stable")[: total - int(shares.sum())]:
        shares[k] += 1
    return [int(s) for s in shares]


def check_mix(cfg: DataConfig) -> None:
    if cfg.path is not None:
        raise DataError(
            "data.mix and data.path are both set; list every shard set in data.mix (with its "
            "weight) and leave data.path unset."
        )
    if not cfg.mix:
        raise DataError("data.mix is empty; list at least one {path, weight} or unset it.")
    for entry in cfg.mix:
        check_shards(cfg.model_copy(update={"path": entry.path, "mix": None}))


def load_mix(cfg: DataConfig) -> Splits:
    check_mix(cfg)
    assert cfg.mix is not None
    loaded = [
        load_shard_source(cfg.model_copy(update={"path": e.path, "mix": None})) for e in cfg.mix
    ]
    first = loaded[0]
    for entry, s in zip(cfg.mix, loaded, strict=True):
        same = (s.input_shape, s.num_classes, s.input_dtype, s.target_shape) == (
            first.input_shape, first.num_classes, first.input_dtype, first.target_shape,
        )  # fmt: skip
        if not same:
            raise DataError(
                f"data.mix set {entry.path} holds samples of shape {s.input_shape} with "
                f"{s.num_classes} classes, unlike {cfg.mix[0].path} ({first.input_shape}, "
                f"{first.num_classes}); mix shard sets written from the same kind of source."
            )
    weights = [e.weight for e in cfg.mix]
    train = MixedSet([s.train for s in loaded], weights, cfg.shuffle)
    val = MixedSet([s.val for s in loaded], [float(len(s.val)) for s in loaded], False)
    version = hashlib.sha256(
        json.dumps([[s.version, w] for s, w in zip(loaded, weights, strict=True)]).encode()
    ).hexdigest()
    return Splits(
        train, val, first.input_shape, first.num_classes, version,
        input_dtype=first.input_dtype, target_shape=first.target_shape, version=version,
        device_normalize=first.device_normalize,
    )  # fmt: skip
