"""Child for test_data_shards_memory.py: stream one epoch of a shard set under an address-space
limit (RLIMIT_AS) of the process's own size after warm-up plus `--margin-mb`.

Warm-up first (a few batches from the first shard: torch's allocator and pyarrow's memory pool
exist), then the limit, then the whole shuffled epoch with a fresh reader. Prints JSON: samples read, the distinct ids,
the limit and the peak RSS."""

from __future__ import annotations

import argparse
import json
import resource


def vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards")
    p.add_argument("--margin-mb", type=int)
    p.add_argument("--cache-shards", type=int)
    a = p.parse_args()

    from hpcml.config import DataConfig
    from hpcml.data.loader import EpochLoader
    from hpcml.data.shards import ShardSet

    # Warm-up on the first shard only (unshuffled): it must not map the shards whose cost the
    # limit is there to catch.
    warm = ShardSet(a.shards, "train", cache_shards=1, with_ids=True)
    warm_loader = EpochLoader(warm, DataConfig(batch_size=16, shuffle=False), 0, 1, 0, False)
    for _ in range(3):
        warm_loader.next()
    del warm_loader, warm
    limit = vm_size_bytes() + a.margin_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    ds = ShardSet(a.shards, "train", cache_shards=a.cache_shards, with_ids=True)
    ld = EpochLoader(ds, DataConfig(batch_size=16), 0, 1, 0, False)
    seen: set[int] = set()
    count = 0
    while True:
        batch = ld.next()
        if ld.epoch != 0:
            break
        seen.update(int(i) for i in batch[2])
        count += len(batch[2])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"count": count, "distinct": len(seen), "limit": limit, "peak_rss": peak_rss}))


if __name__ == "__main__":
    main()
