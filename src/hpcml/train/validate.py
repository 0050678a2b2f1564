"""The whole resolved config checked without a process group and without materializing the model.

`hpcml train --nproc N` runs `resolve` in the parent before torchrun starts, so the common
mistakes (a tp that does not divide the heads, a batch larger than the data, a typo in
`model.args`, a missing data folder, an eval set smaller than the ranks) end as one sentence,
exit 2, before any worker exists. Every worker runs it again first thing (an external torchrun
has no parent of ours): it is deterministic, so all ranks raise the same error before the first
collective and no rank is left waiting in one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.data.sources import Splits, load_source
from hpcml.distributed.parallel import check_parallel
from hpcml.errors import DataError
from hpcml.models.zoo import build_model, complete_args, get_spec


@dataclass
class Resolved:
    splits: Splits
    model_args: dict[str, Any]
    meta_model: nn.Module
    """The model built on the meta device: shapes and parameter names, no storage."""
    world_size: int
    dp_size: int


def resolve(cfg: RunConfig, world_size: int) -> Resolved:
    """Load the data's description, build the model on meta and check the layout; raises an
    `HpcmlError` with one sentence for the first problem found."""
    get_spec(cfg.model.name)
    splits = load_source(cfg.data)
    model_args = complete_args(
        cfg.model.name, cfg.model.args, splits.input_shape, splits.num_classes
    )
    with torch.device("meta"):
        model = build_model(cfg.model.name, model_args)
    check_parallel(model, world_size, cfg.parallel.tp, cfg.parallel, cfg.precision)
    dp_size = world_size // cfg.parallel.tp
    check_batch(cfg, splits, dp_size)
    check_loss(cfg)
    return Resolved(splits, model_args, model, world_size, dp_size)


def train_samples_per_replica(splits: Splits, dp_size: int, seed: int) -> int:
    make_sampler = getattr(splits.train, "make_sampler", None)
    if make_sampler is not None:
        return len(make_sampler(0, dp_size, seed))
    return len(splits.train) // dp_size  # type: ignore[arg-type]


def check_batch(cfg: RunConfig, splits: Splits, dp_size: int) -> None:
    per_replica = train_samples_per_replica(splits, dp_size, cfg.train.seed)
    if per_replica < cfg.data.batch_size:
        total = per_replica * dp_size
        raise DataError(
            f"data.batch_size {cfg.data.batch_size} x {dp_size} data-parallel processes is "
            f"larger than the {total} training samples of data.source '{cfg.data.source}'; "
            "lower data.batch_size or use more data."
        )
    n_val = len(splits.val)  # type: ignore[arg-type]
    if n_val < dp_size:
        raise DataError(
            f"data.source '{cfg.data.source}' has {n_val} validation samples, fewer than the "
            f"{dp_size} data-parallel processes that each evaluate a share; raise "
            "data.val_fraction (or data.eval_windows) or start fewer processes."
        )


def check_loss(cfg: RunConfig) -> None:
    """`train.loss` names a known loss or an importable callable (resolved again per worker)."""
    from hpcml.train.losses import resolve_loss

    resolve_loss(cfg.train.loss)
