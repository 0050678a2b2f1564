"""Sharded, resumable loading: each rank reads its own part (DistributedSampler semantics) and
the loader position is checkpointable (torchdata's StatefulDataLoader), so a resume continues
mid-epoch on the next unseen batch.

The global order of an epoch is a function of (seed, epoch) alone (DistributedSampler's
permutation); rank r of W takes every W-th sample of it, so after k batches of b per rank the
ranks together have seen exactly its first k*b*W samples. That global position is what a resume
on another world size continues from (`resume_at`): the rest of the epoch, split over the new
ranks. Token windows (`make_sampler`) draw per world size and restart at the next epoch."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from hpcml.config import DataConfig
from hpcml.data.shards.order import Layout, OrderSampler, dealt_order

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
        # A shard set shuffled a window of shards at a time, or a mix of sets (whose order
        # draws from the sets by weight even unshuffled: `order_always`).
        ordered = getattr(dataset, "has_epoch_order", False) and (
            cfg.shuffle or getattr(dataset, "order_always", False)
        )
        self.sampler: Any
        self.layout: Layout | None = None
        """Who reads an epoch of a dealt order (`hpcml.data.shards.order.streams`): each loader
        worker of each rank reads its own piece of the shards."""
        if make_sampler is not None:
            self.sampler = make_sampler(rank, world_size, seed)
        elif ordered:
            if getattr(dataset, "dealt", False):  # its order can be cut into reader pieces
                self.layout = Layout(world_size, cfg.num_workers, cfg.batch_size)
            order_of = functools.partial(epoch_order, dataset, seed, self.layout)
            self.sampler = OrderSampler(order_of, len(dataset), rank, world_size)  # type: ignore[arg-type]
        else:
            self.sampler = DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=cfg.shuffle,
                seed=seed,
                drop_last=True,
            )
        keyed = getattr(dataset, "epoch_keyed", False)
        workers = cfg.num_workers
        generator = torch.Generator().manual_seed(seed + rank)
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=EpochKeys(self.sampler, seed) if keyed else self.sampler,
            drop_last=True,
            generator=generator,
            **_worker_args(cfg, pin_memory, cfg.persistent_workers),
        )
        if len(self.loader) == 0:
            from hpcml.errors import DataError

            raise DataError(
                f"data.batch_size {cfg.batch_size} x {world_size} processes is larger than the "
                f"{len(dataset)} training samples of data.source '{cfg.source}'; lower data.batch_size."  # type: ignore[arg-type]
            )
        self.epoch = 0
        self.taken = 0
        """Batches this rank has taken in the current epoch."""
        self.batch_size, self.rank, self.world_size = cfg.batch_size, rank, world_size
        self.shuffle, self.seed, self.dataset = cfg.shuffle, seed, dataset
        self.keyed = keyed
        self.workers = workers
        self.cfg, self.pin_memory = cfg, pin_memory
        self._it: Iterator[Any] | None = None
        self._remainder = False
        self._base = 0
        """Samples of the epoch taken before a resume on another world size."""
        self._epoch_layout = self.layout
        """The layout the current epoch's order was dealt for (a resumed epoch keeps the one
        it started with; the next epoch takes this loader's)."""

    def __len__(self) -> int:
        return len(self.loader)

    def _start_epoch(self) -> None:
        self.sampler.set_epoch(self.epoch)
        self._it = iter(self.loader)
        self.taken = 0
        self._remainder = False
        self._base = 0
        self._epoch_layout = self.layout

    def next(self) -> Any:
        if self._it is None:
            self._start_epoch()
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch += 1
            self._start_epoch()
            batch = next(self._it)
        self.taken += 1
        return batch

    @property
    def elastic(self) -> bool:
        return isinstance(self.sampler, (DistributedSampler, OrderSampler))

    def position(self) -> dict[str, Any]:
        """Where the epoch stands globally: samples all ranks together have taken (and, for a
        dealt order, the layout it was dealt for, which a resume rebuilds it with)."""
        done = self._base + self.taken * self.batch_size * self.world_size
        if self.layout is None:
            return {"epoch": self.epoch, "samples": done}
        laid = None if self._epoch_layout is None else list(self._epoch_layout)
        return {"epoch": self.epoch, "samples": done, "layout": laid}

    def state_dict(self) -> dict[str, Any]:
        laid = {} if self.layout is None else {"layout": self.position()["layout"]}
        if self._remainder:  # a deterministic sampler: its position says it all
            return {
                "epoch": self.epoch,
                "taken": self.taken,
                "loader": None,
                "remainder_at": self.position()["samples"],
                **laid,
            }
        return {
            "epoch": self.epoch,
            "taken": self.taken,
            "workers": self.workers,
            "loader": self.loader.state_dict() if self._it else None,
            **laid,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_layout = state.get("layout")
        if state.get("remainder_at") is not None:
            self.resume_at(int(state["epoch"]), int(state["remainder_at"]), saved_layout)
            return
        self.epoch = int(state["epoch"])
        loader_state = state.get("loader")
        self.sampler.set_epoch(self.epoch)
        taken = int(state.get("taken", 0))
        if loader_state is not None and loader_state.get("_iterator_finished"):
            self.epoch += 1
            loader_state, taken = None, 0
        other_layout = self.layout is not None and _layout(saved_layout) != self.layout
        if loader_state is not None and (_other_workers(state, self.workers) or other_layout):
            # StatefulDataLoader cannot load another worker count's state (it asserts), nor
            # replay an order dealt for another layout; the global position can, exactly:
            # taken batches of every rank of this same world, in the order it was dealt.
            at = taken * self.batch_size * self.world_size
            self.resume_at(self.epoch, at, saved_layout)
            return
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        self._start_epoch()
        self.taken = taken

    def resume_at(self, epoch: int, samples: int, layout: Any = None) -> None:
        """Continue epoch `epoch` after its first `samples` samples of the global order (written
        by any world size): the rest of the epoch split over this world, then epochs as usual.
        A dealt order is rebuilt for the `layout` the position was saved with (None: one
        piece, the order of positions saved before layouts were)."""
        remainder_of = getattr(self.sampler, "remainder", None)  # e.g. token windows
        rest: Any
        if remainder_of is not None:
            rest = remainder_of(epoch, samples)
        elif not self.elastic:
            self.load_state_dict({"epoch": epoch + 1, "loader": None})
            return
        else:
            if isinstance(self.sampler, OrderSampler):
                laid = _layout(layout) if self.layout is not None else None
                order = epoch_order(self.dataset, self.seed, laid, epoch).tolist()
                self._epoch_layout = laid
            else:
                order = _permutation(len(self.dataset), self.seed, epoch, self.shuffle)  # type: ignore[arg-type]
            rest = RemainderSampler(order, samples, self.rank, self.world_size)
        # The configured workers, prefetch and pinned memory, as in any other epoch; workers
        # that persist would outlive this one-epoch loader, so they do not.
        remainder = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=EpochKeys(rest, self.seed, epoch) if self.keyed else rest,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.seed + self.rank + epoch),
            **_worker_args(self.cfg, self.pin_memory, persistent=False),
        )
        self.epoch = epoch
        self._it = iter(remainder)
        self._remainder = True
        self._base, self.taken = samples, 0


def epoch_order(dataset: Any, seed: int, layout: Layout | None, epoch: int) -> Any:
    """The global order of an epoch of an ordered dataset (`has_epoch_order`), dealt for
    `layout` (`hpcml.data.shards.order.dealt_order`); None: its one-piece order."""
    if layout is None:
        return dataset.epoch_order(seed, epoch)
    return dealt_order(
        lambda pieces: dataset.epoch_order(seed, epoch, pieces), len(dataset), layout
    )


def _layout(saved: Any) -> Layout | None:
    return None if saved is None else Layout(*(int(v) for v in saved))


def _worker_args(cfg: DataConfig, pin_memory: bool, persistent: bool) -> dict[str, Any]:
    """DataLoader arguments for the configured loader workers."""
    kwargs: dict[str, Any] = {"num_workers": cfg.num_workers, "pin_memory": pin_memory}
    if cfg.num_workers > 0:
        kwargs["persistent_workers"] = persistent
        if cfg.prefetch_factor is not None:
            kwargs["prefetch_factor"] = cfg.prefetch_factor
    return kwargs


def _other_workers(state: dict[str, Any], workers: int) -> bool:
    """Whether a state was saved with another loader worker count. States written before the
    count was stored tell 0 from >0 by StatefulDataLoader's multi-process snapshot key."""
    if "workers" in state:
        return int(state["workers"]) != workers
    return ("_snapshot" in (state.get("loader") or {})) != (workers > 0)


class EpochKeys(torch.utils.data.Sampler[tuple[int, int, int]]):
    """A sampler's indices as (seed, epoch, index) keys, for datasets whose per-sample
    randomness is keyed by them (`epoch_keyed`, e.g. augmentation). The epoch is the inner
    sampler's (`set_epoch`), or fixed for a one-epoch remainder."""

    def __init__(self, inner: Any, seed: int, epoch: int | None = None) -> None:
        self.inner, self.seed, self.fixed_epoch = inner, seed, epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        epoch = self.fixed_epoch if self.fixed_epoch is not None else self.inner.epoch
        return ((self.seed, epoch, int(i)) for i in self.inner)


def _permutation(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """DistributedSampler's global order of one epoch (its permutation of (seed, epoch), the
    same code path: torch.randperm on a seeded generator)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


class RemainderSampler(torch.utils.data.Sampler[int]):
    """An epoch's global `order` from position `start` on, strided over the ranks."""

    def __init__(self, order: list[int], start: int, rank: int, world: int) -> None:
        rest = order[start:]
        usable = len(rest) // world * world
        self.indices = rest[rank:usable:world]

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


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
        if not 0 <= i < self.length:
            raise IndexError(i)  # also ends plain iteration, which stops at IndexError
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
