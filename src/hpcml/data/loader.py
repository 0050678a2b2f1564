"""Sharded, resumable loading: each rank reads its own part (DistributedSampler semantics) and
the loader position is checkpointable (torchdata's StatefulDataLoader), so a resume continues
mid-epoch on the next unseen batch."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from hpcml.config import DataConfig

# torchdata 0.11 calls a deprecated torch API on every iterator; the warning says nothing to users.
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")


class EpochLoader:
    """Endless iterator over epochs of a StatefulDataLoader, with a state dict for checkpoints."""

    def __init__(
        self,
        dataset: Dataset,
        cfg: DataConfig,
        rank: int,
        world_size: int,
        seed: int,
        pin_memory: bool,
    ) -> None:
        make_sampler = getattr(dataset, "make_sampler", None)  # e.g. random token windows
        self.sampler: Any = (
            make_sampler(rank, world_size, seed)
            if make_sampler is not None
            else DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=cfg.shuffle,
                seed=seed,
                drop_last=True,
            )
        )
        workers = cfg.num_workers
        generator = torch.Generator().manual_seed(seed + rank)
        kwargs: dict[str, Any] = {}
        if workers > 0:
            kwargs["persistent_workers"] = cfg.persistent_workers
            if cfg.prefetch_factor is not None:
                kwargs["prefetch_factor"] = cfg.prefetch_factor
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=workers,
            pin_memory=pin_memory,
            generator=generator,
            **kwargs,
        )
        if len(self.loader) == 0:
            from hpcml.errors import DataError

            raise DataError(
                f"data.batch_size {cfg.batch_size} x {world_size} processes is larger than the "
                f"{len(dataset)} training samples of data.source '{cfg.source}'; lower data.batch_size."  # type: ignore[arg-type]
            )
        self.epoch = 0
        self._it: Iterator[Any] | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def _start_epoch(self) -> None:
        self.sampler.set_epoch(self.epoch)
        self._it = iter(self.loader)

    def next(self) -> Any:
        if self._it is None:
            self._start_epoch()
        assert self._it is not None
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._start_epoch()
            return next(self._it)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loader": self.loader.state_dict() if self._it else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        loader_state = state.get("loader")
        self.sampler.set_epoch(self.epoch)
        if loader_state is not None and loader_state.get("_iterator_finished"):
            self.epoch += 1
            loader_state = None
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        self._start_epoch()


class EvalShard(Dataset):
    """Rank r's share of the validation set: samples r, r+W, r+2W... (no sample twice, so the
    reduced sums are exact), padded with masked copies of its first sample to ceil(n / W), the
    largest share: then every rank runs the same number of eval batches. Items are
    (input, target, valid)."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        self.dataset = dataset
        self.indices = range(rank, n, world_size)
        self.length = -(-n // world_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Any, Any, bool]:
        valid = i < len(self.indices)
        x, y = self.dataset[self.indices[i if valid else 0]]
        return x, y, valid


def shard_for_eval(dataset: Dataset, rank: int, world_size: int) -> Dataset:
    return EvalShard(dataset, rank, world_size)


def eval_loader(dataset: Dataset, batch_size: int, pin_memory: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=0,
        pin_memory=pin_memory,
        # Own generator: evaluating must not draw from the global RNG that training uses.
        generator=torch.Generator().manual_seed(0),
    )
