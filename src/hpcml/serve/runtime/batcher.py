"""Dynamic batching: requests from many clients merged into one forward pass and split back.

One `DynamicBatcher` per model version owns a bounded queue (counted in samples) and one worker
task per model instance. A worker cuts a batch when it is full, when it reaches the largest
preferred size, or when the oldest request has waited `max_queue_delay_ms`; while all instances
compute, requests pile up and the next batch is cut at once. A full queue refuses new requests
immediately (`QueueFull`), so memory never grows without bound; a request not answered within
its timeout fails with `RequestTimeout` and is dropped from the queue if it has not started.

Supervision: an instance whose child process dies (`WorkerDied`, or its pipe closing while
idle) is restarted by its worker task with exponential backoff. Its in-flight batch fails with
`WorkerLost` (retryable: HTTP 503 + Retry-After); while no instance is alive the batcher is not
`healthy`, queued requests fail with `WorkerLost` at once and new ones are refused the same way,
so readiness probes and clients see the outage instead of waiting on it. An instance that can
be killed (a child process) and does not answer a batch within `batch_timeout_s` is taken as
hung (stopped, wedged): it is killed, its batch fails with `WorkerLost`, and it is restarted
like one that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from hpcml.serve.metrics import BatcherMetrics
from hpcml.serve.runtime.backends import Backend, WorkerDied

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds `max_queue_size` samples already."""


class RequestTimeout(Exception):
    """The request was not answered within its timeout."""


class BatcherClosed(Exception):
    """The batcher is draining for shutdown and takes no new requests."""


class BackendFailed(Exception):
    """The backend raised while computing the batch this request was in."""


class WorkerLost(Exception):
    """The process that computed (or would compute) this request died; retrying is safe."""


@dataclass
class InferResult:
    output: np.ndarray
    queue_s: float
    compute_s: float
    batch_size: int
    started: float = 0.0
    """time.perf_counter() when its batch's forward pass began."""
    batch: int = 0
    """Number of its batch in this batcher (requests computed together share it)."""


@dataclass(eq=False)
class _Item:
    x: np.ndarray
    n: int
    future: asyncio.Future[InferResult]
    enqueued_at: float
    queued: bool = True
    """False once a worker took it or it was abandoned (timeout, client gone)."""


@dataclass
class BatchingStats:
    batches: int = 0
    samples: int = 0
    max_batch: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    compute_ns: dict[int, int] = field(default_factory=dict)
    """Batch size -> nanoseconds spent computing batches of that size."""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class DynamicBatcher:
    def __init__(
        self,
        instances: Sequence[Backend],
        max_batch_size: int = 32,
        max_queue_delay_ms: float = 2.0,
        preferred_batch_sizes: Sequence[int] = (),
        max_queue_size: int = 256,
        metrics: BatcherMetrics | None = None,
        restart_backoff_s: tuple[float, float] = (0.5, 30.0),
        on_restart: Callable[[], None] | None = None,
        batch_timeout_s: float | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a batcher needs at least one backend instance")
        self.instances = list(instances)
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_ms / 1000.0
        self.preferred = sorted(s for s in set(preferred_batch_sizes) if s <= max_batch_size)
        self.max_queue_size = max(max_queue_size, max_batch_size)
        self.metrics = metrics
        self.stats = BatchingStats()
        self._queue: deque[_Item] = deque()
        self._pending = 0
        self._waiters: set[asyncio.Future[None]] = set()
        self._workers: list[asyncio.Task[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._closing = False
        self.restart_backoff_s = restart_backoff_s
        """(first delay, longest delay): doubled per restart that did not stay up 30 s."""
        self.on_restart = on_restart
        self.batch_timeout_s = batch_timeout_s
        """A killable instance that takes longer for one batch is hung; None: never."""
        self.restarts = 0
        self._down: set[int] = set()
        """Indexes of instances whose process died and is being restarted."""

    @property
    def queue_depth(self) -> int:
        """Samples waiting for a worker (taken and abandoned ones excluded)."""
        return self._pending

    @property
    def running(self) -> bool:
        return bool(self._workers) and not self._closing

    @property
    def healthy(self) -> bool:
        """Some instance is alive to compute (False while every one is being restarted)."""
        return len(self._down) < len(self.instances)

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(len(self.instances), thread_name_prefix="hpcml-infer")
        for i, backend in enumerate(self.instances):
            await self._watch(i, backend)
        self._workers = [asyncio.create_task(self._work(i)) for i in range(len(self.instances))]

    async def _watch(self, index: int, backend: Backend) -> None:
        watch = getattr(backend, "watch", None)
        if watch is not None:
            await watch(lambda: self._mark_down(index))

    def _mark_down(self, index: int) -> None:
        """Instance `index` died: not ready at once; with none left, fail what waits for it."""
        if self._closing or index in self._down:
            return
        self._down.add(index)
        if not self.healthy:
            while self._queue:
                item = self._queue.popleft()
                if item.queued:
                    item.queued = False
                    if not item.future.done():
                        item.future.set_exception(WorkerLost())
            self._set_pending(0)
        self._wake()

    async def infer(self, x: np.ndarray, timeout_s: float) -> InferResult:
        """Queue `x` (batch axis first) and wait for its share of a batched forward pass."""
        if self._closing or not self._workers:
            raise BatcherClosed()
        if not self.healthy:
            raise WorkerLost()
        n = int(x.shape[0])
        if self._pending + n > self.max_queue_size:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        item = _Item(x, n, loop.create_future(), time.perf_counter())
        self._queue.append(item)
        self._set_pending(self._pending + n)
        self._wake()
        timer = loop.call_later(timeout_s, self._expire, item)
        try:
            return await item.future
        finally:
            timer.cancel()
            # Timed out or cancelled (client went away) while still queued: free its place now.
            if item.queued:
                item.queued = False
                self._set_pending(self._pending - n)

    async def close(self) -> None:
        """Take no new requests, finish every queued one, then stop the workers."""
        self._closing = True
        self._wake()
        for index in self._down:  # asleep in a restart backoff: nothing left to do
            self._workers[index].cancel()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._workers = []

    def _set_pending(self, value: int) -> None:
        self._pending = value
        if self.metrics is not None:
            self.metrics.queue_depth.set(value)

    def _expire(self, item: _Item) -> None:
        if not item.future.done():
            item.future.set_exception(RequestTimeout())

    def _wake(self) -> None:
        for fut in self._waiters:
            _resolve(fut)

    async def _wait(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.add(fut)
        handle = loop.call_later(timeout_s, _resolve, fut) if timeout_s is not None else None
        try:
            await fut
        finally:
            self._waiters.discard(fut)
            if handle is not None:
                handle.cancel()

    def _drop_abandoned_head(self) -> None:
        while self._queue and not self._queue[0].queued:
            self._queue.popleft()

    def _cut_size(self) -> int:
        """Samples that make a batch worth sending before the delay runs out."""
        return self.preferred[-1] if self.preferred else self.max_batch_size

    def _take(self) -> list[_Item]:
        limit = self.max_batch_size
        if self.preferred:
            fitting = [s for s in self.preferred if s <= self._pending]
            if fitting:
                limit = fitting[-1]
        batch: list[_Item] = []
        total = 0
        while self._queue:
            item = self._queue[0]
            if not item.queued:
                self._queue.popleft()
                continue
            if batch and total + item.n > limit:
                break
            self._queue.popleft()
            item.queued = False
            batch.append(item)
            total += item.n
        self._set_pending(self._pending - total)
        return batch

    async def _work(self, index: int) -> None:
        backend = self.instances[index]
        loop = asyncio.get_running_loop()
        backoff_in_row = 0
        up_since = time.monotonic()
        while True:
            if index in self._down:
                if self._closing:
                    return
                # A child that dies (or fails to load) soon after the last attempt backs off
                # twice as long as before; one that stayed up 30 s starts from the first delay.
                if time.monotonic() - up_since >= 30:
                    backoff_in_row = 0
                first, longest = self.restart_backoff_s
                await asyncio.sleep(min(first * 2**backoff_in_row, longest))
                backoff_in_row += 1
                await self._restart(index, backend)
                up_since = time.monotonic()
                continue
            self._drop_abandoned_head()
            if not self._queue:
                if self._closing:
                    return
                await self._wait(None)
                continue
            cut_at = self._queue[0].enqueued_at + self.max_queue_delay_s
            while self._pending < self._cut_size() and not self._closing:
                remaining = cut_at - time.perf_counter()
                if remaining <= 0:
                    break
                await self._wait(remaining)
                self._drop_abandoned_head()
                if not self._queue:
                    break
            if index in self._down:
                continue
            batch = self._take()
            if batch and not await self._run(loop, backend, batch):
                self._mark_down(index)

    async def _restart(self, index: int, backend: Backend) -> bool:
        restart = getattr(backend, "restart", None)
        if restart is None or self._closing:
            return False
        try:
            await asyncio.to_thread(restart)
            await self._watch(index, backend)
        except Exception as exc:  # noqa: BLE001 - retried with a longer backoff
            log.warning("restarting an inference process failed (%s); retrying", exc)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(backend.close)
            return False
        self._down.discard(index)
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart()
        self._wake()
        return True

    async def _within_deadline(self, backend: Backend, answer: Awaitable[np.ndarray]) -> np.ndarray:
        kill = getattr(backend, "kill", None)
        if self.batch_timeout_s is None or kill is None:
            return await answer
        try:
            return await asyncio.wait_for(answer, self.batch_timeout_s)
        except TimeoutError:
            log.warning(
                "an inference process answered no batch in %g s (hung or stopped); killing it",
                self.batch_timeout_s,
            )
            kill()
            raise WorkerDied(f"no answer within {self.batch_timeout_s:g} s") from None

    async def _run(
        self, loop: asyncio.AbstractEventLoop, backend: Backend, batch: list[_Item]
    ) -> bool:
        """Compute one batch and answer its requests; False when the instance's process died."""
        started = time.perf_counter()
        x = batch[0].x if len(batch) == 1 else np.concatenate([it.x for it in batch])
        size = int(x.shape[0])
        try:
            # Backends that can be driven from the loop skip the thread hop.
            infer_async = getattr(backend, "infer_async", None)
            if infer_async is not None:
                out = await self._within_deadline(backend, infer_async(x))
            else:
                out = await loop.run_in_executor(self._executor, backend.infer, x)
            if out.shape[0] != size:
                raise RuntimeError(f"backend returned {out.shape[0]} rows for a batch of {size}")
        except WorkerDied:
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(WorkerLost())
            return False
        except Exception as exc:  # noqa: BLE001 - the requests fail, the worker lives on
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(BackendFailed(f"{type(exc).__name__}: {exc}"))
            return True
        compute_s = time.perf_counter() - started
        self.stats.batches += 1
        self.stats.samples += size
        self.stats.max_batch = max(self.stats.max_batch, size)
        self.stats.sizes[size] = self.stats.sizes.get(size, 0) + 1
        self.stats.compute_ns[size] = self.stats.compute_ns.get(size, 0) + int(compute_s * 1e9)
        if self.metrics is not None:
            self.metrics.batch_size.observe(size)
            self.metrics.compute_s.observe(compute_s)
        offset = 0
        for it in batch:
            queue_s = started - it.enqueued_at
            if self.metrics is not None:
                self.metrics.queue_s.observe(queue_s)
            if not it.future.done():
                it.future.set_result(
                    InferResult(
                        out[offset : offset + it.n],
                        queue_s,
                        compute_s,
                        size,
                        started,
                        self.stats.batches,
                    )
                )
            offset += it.n
        return True
