"""Elastic data position: the global order of an epoch depends on (seed, epoch) alone, and a
resume on another world size continues at the next unseen global sample, so over the epoch
every sample is seen exactly once (2 -> 1 and 1 -> 2 ranks, mid-epoch)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader

N, B, SEED = 96, 4, 7


def loaders(world: int) -> list[EpochLoader]:
    data = TensorDataset(torch.arange(N), torch.zeros(N, dtype=torch.long))
    cfg = DataConfig(batch_size=B, shuffle=True)
    return [EpochLoader(data, cfg, r, world, SEED, False) for r in range(world)]


def take(loader: EpochLoader, batches: int) -> list[int]:
    return [int(i) for _ in range(batches) for i in loader.next()[0]]


@pytest.mark.parametrize(("before", "after", "steps"), [(2, 1, 5), (1, 2, 7), (2, 3, 3)])
def test_resume_on_another_world_size_sees_each_sample_once(before: int, after: int, steps: int):
    first = loaders(before)
    seen = [i for ld in first for i in take(ld, steps)]
    position = first[0].position()
    assert position == {"epoch": 0, "samples": steps * B * before}
    second = loaders(after)
    for ld in second:
        ld.resume_at(position["epoch"], position["samples"])
    per_epoch = (N - position["samples"]) // (B * after)
    rest = [i for ld in second for i in take(ld, per_epoch)]
    dropped = (N - position["samples"]) - per_epoch * B * after  # drop_last of the new world
    assert len(seen) + len(rest) == N - dropped
    assert len(set(seen) | set(rest)) == len(seen) + len(rest)  # nobody saw a sample twice
    assert not set(seen) & set(rest)
    # The epoch then ends on every new rank and the next one starts from its own order.
    nxt = [ld.next()[0] for ld in second]
    assert all(ld.epoch == 1 for ld in second)
    again = loaders(after)
    for ld in again:
        ld.load_state_dict({"epoch": 1, "loader": None})
    assert all(torch.equal(a, ld.next()[0]) for a, ld in zip(nxt, again, strict=True))


def test_position_survives_a_second_resume_mid_remainder():
    """1 rank took 5 batches; 2 ranks continue for 3 and save; 1 rank continues from there."""
    (one,) = loaders(1)
    seen = take(one, 5)
    two = loaders(2)
    for ld in two:
        ld.resume_at(0, one.position()["samples"])
    seen += [i for ld in two for i in take(ld, 3)]
    state = two[0].state_dict()
    assert two[0].position()["samples"] == 5 * B + 3 * B * 2
    (back,) = loaders(1)
    back.load_state_dict(state)  # the same position, read by a single rank this time
    (fresh,) = loaders(1)
    fresh.resume_at(0, two[0].position()["samples"])
    rest = take(back, (N - len(seen)) // B)
    assert rest == take(fresh, (N - len(seen)) // B)
    assert sorted(seen + rest) == list(range(N))
