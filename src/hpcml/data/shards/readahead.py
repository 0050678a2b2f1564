"""The open shards of one reading process, with read-ahead (`data.shard_cache`, `data.readahead`).

Why a module of its own: a remote shard is a download, so while the samples of shard k are read
the next shard this process will need can already be on its way. `ShardSlots` keeps at most
`capacity` shards per process, open or being fetched, in one least-recently-used order, so
read-ahead never holds more than `data.shard_cache` shards. A fetch runs in one background
thread per process (started lazily and again after a fork: a thread does not survive one); its
result, or its error, is taken when the shard is first used, so a failing shard fails where it
would have failed without read-ahead. Which samples are read, and in what order, is the
caller's: read-ahead only changes when bytes arrive.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class ShardSlots:
    """Shard readers by shard number, at most `capacity` of them open or in flight."""

    def __init__(
        self,
        open_shard: Callable[[int], Any],
        capacity: int,
        readahead: int,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.open_shard, self.capacity, self.on_evict = open_shard, capacity, on_evict
        self.readahead = max(0, min(readahead, capacity - 1))  # the shard in use keeps a slot
        self._slots: OrderedDict[int, Any] = OrderedDict()  # reader, or Future of one
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self.events: list[tuple[str, int, str]] | None = None
        """When a list: ("fetch", k, thread name) at the start of each fetch and ("use", k,
        thread name) at each first use of a fetched shard (tests, diagnostics)."""

    def __len__(self) -> int:
        return len(self._slots)

    def is_open(self, k: int) -> bool:
        """Shard k is held and fetched (not in flight)."""
        return k in self._slots and not isinstance(self._slots[k], Future)

    def get(self, k: int) -> Any:
        """Shard k's reader: open already, fetched ahead (waited for), or fetched now."""
        self._after_fork()
        slot = self._slots.get(k)
        if slot is not None and not isinstance(slot, Future):
            self._slots.move_to_end(k)
            return slot
        if slot is None:
            self._make_room(keep=None)
            reader = self._fetch(k)
        else:
            del self._slots[k]  # if it failed, the next use fetches again
            reader = slot.result()
        self._slots[k] = reader
        self._note("use", k)
        return reader

    def prefetch(self, upcoming: Iterable[int], current: int) -> None:
        """Start fetching the first `readahead` shards of `upcoming` not held yet, evicting
        least recently used ones other than `current` to keep within `capacity`."""
        if self.readahead == 0:
            return
        self._after_fork()
        started = 0
        for k in dict.fromkeys(upcoming):
            if started >= self.readahead:
                break
            if k == current:
                continue
            started += 1
            if k in self._slots:
                continue
            if not self._make_room(keep=current):
                break
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpcml-readahead")
            self._slots[k] = self._pool.submit(self._fetch, k)

    def clear(self) -> None:
        for k in list(self._slots):
            self._evict(k)

    def _make_room(self, keep: int | None) -> bool:
        """Free slots down to capacity - 1. For a shard needed now (`keep` None) the least
        recently used entry goes, a fetch ahead included; for a fetch ahead only open shards
        other than `keep` go (one fetched ahead is about to be used: it never makes room for
        another), and False says there is no room."""
        while len(self._slots) >= self.capacity:
            if keep is None:
                victim = next(iter(self._slots))
            else:
                victim = next(
                    (k for k, v in self._slots.items() if k != keep and not isinstance(v, Future)),
                    None,
                )
                if victim is None:
                    return False
            self._evict(victim)
        return True

    def _evict(self, k: int) -> None:
        slot = self._slots.pop(k)
        if isinstance(slot, Future):
            slot.cancel()  # not started yet: never runs; running: its result is dropped
        if self.on_evict is not None:
            self.on_evict(k)

    def _fetch(self, k: int) -> Any:
        self._note("fetch", k)
        return self.open_shard(k)

    def _note(self, what: str, k: int) -> None:
        if self.events is not None:
            self.events.append((what, k, threading.current_thread().name))

    def _after_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked loader worker: the parent's thread is not here
            self._pid, self._pool = os.getpid(), None
            self._slots = OrderedDict(
                (k, v) for k, v in self._slots.items() if not isinstance(v, Future)
            )
