"""torchrun worker for test_data_verify.py: every rank verifies one shard set with the hashing
split over the ranks (as `data.verify: full` does at load), each rank with its own hash cache
folder (ARGV[2]/rank-R), so the test can read which files each rank hashed."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from hpcml.data.shards import read_manifest, verify


def main() -> None:
    root, caches = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    os.environ["HPCML_CACHE_DIR"] = os.path.join(caches, f"rank-{dist.get_rank()}")
    verify(root, read_manifest(root), shared=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
