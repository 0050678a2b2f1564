"""torchrun worker for test_data_shards_elastic.py: two ranks over gloo.

(a) continue the epoch a 1-process loader left at `--resume-samples` (the 1 -> 2 resume):
    every remaining batch of the epoch; (b) a fresh 2-process epoch: `--take` batches, then its
    global position (the 2 -> 1 resume starts there). Rank 0 gathers the sample ids (read from
    the shards' id column) of every rank and writes them as JSON."""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet


def ids(batch) -> list[int]:
    return [int(i) for i in batch[2]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards")
    p.add_argument("--out")
    p.add_argument("--batch", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--resume-samples", type=int)
    p.add_argument("--take", type=int)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ShardSet(a.shards, "train", cache_shards=2, with_ids=True)
    cfg = DataConfig(batch_size=a.batch, num_workers=0)

    resumed = EpochLoader(ds, cfg, rank, world, a.seed, False)
    resumed.resume_at(0, a.resume_samples)
    rest: list[list[int]] = []
    while True:
        batch = resumed.next()
        if resumed.epoch != 0:  # the remainder ended: this batch opens epoch 1
            break
        rest.append(ids(batch))

    fresh = EpochLoader(ds, cfg, rank, world, a.seed, False)
    first = [ids(fresh.next()) for _ in range(a.take)]
    position = fresh.position()

    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "rest": rest, "first": first})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world": world, "ranks": gathered, "position": position}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
