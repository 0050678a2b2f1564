"""One served text model: its engine stepping in a supervised child process, and token streams
on the event loop.

The engine runs in a process of its own (`engine_process`): a crash there (a kernel's
segfault, the OOM killer, kill -9) fails the requests it was generating, each with one
"retry" sentence, and the server starts a new engine process at once; requests that arrive
meanwhile wait for it. Requests and cancellations go to the process as frames written by the
event loop (non-blocking); each step's tokens come back as one frame the event loop reads and
hands to the requests' `asyncio.Queue`s. Metrics (Prometheus, in the server's registry): time
to first token, inter-token latency, end-to-end latency, queue time, prompt and output tokens,
prefix-cache hit and query tokens, sequences per step, preemptions, running and waiting
sequences, KV blocks used, refused requests, engine restarts.

A request that fails ends with an "abort" event whose `reason` is one sentence naming the real
cause (the engine process died, it cannot start, the server is shutting down, the deadline
passed), which the HTTP endpoints answer with 503 and Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from hpcml.errors import ModelError
from hpcml.serve.generate.engine import TokenEvent, check_request
from hpcml.serve.generate.engine_process import EngineSpec, StepStats, run_engine
from hpcml.serve.generate.llm_metrics import GenerationMetrics
from hpcml.serve.generate.sampling import SamplingParams, Tokenizer
from hpcml.serve.runtime.backends import FrameProtocol, frame, read_frame

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down; retry on another replica."


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class QueueFull(Exception):
    """More requests wait for the engine than `generation.max_waiting` (answer 429)."""

    retry_after_s = 1


ADMISSION_HOLD_S = 5.0
"""How long an admitted sequence that has not reached `generate` yet counts as waiting: the
endpoints admit a request, then start its generation a loop iteration or more later (a
streamed response's body, a non-streamed request's task), so a burst of requests admitted in
between would each see the others uncounted; a request whose client left before its
generation began never reaches `generate`, and stops counting after this long."""


@dataclass
class _Stream:
    events: asyncio.Queue[TokenEvent]
    submitted: float
    last: float | None = None
    done: bool = False


class _Messages(FrameProtocol):
    """The engine process's messages (pickled frames), each handed to `on_message` as it
    arrives on the event loop; `on_lost` once its end of the pipe closes (it exited or died)."""

    def __init__(self, on_message: Any, on_lost: Any) -> None:
        super().__init__()
        self.on_message, self.on_lost = on_message, on_lost

    def frame_received(self, frame: bytes) -> None:
        self.on_message(pickle.loads(frame))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.on_lost is not None:
            self.on_lost()


class _Process:
    """One engine process and the server's two pipe ends to it."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_in, self.commands = ctx.Pipe(duplex=False)
        self.events, events_out = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_engine,
            args=(spec, commands_in, events_out),
            daemon=True,
            name=f"hpcml-llm-{spec.name}",
        )
        self.proc.start()
        commands_in.close()
        events_out.close()
        self.reader: asyncio.ReadTransport | None = None
        self.writer: asyncio.WriteTransport | None = None
        self.protocol: _Messages | None = None

    def wait_ready(self, export_dir: str) -> None:
        """Block until the process has built its engine; ModelError if it could not."""
        try:
            status, detail = pickle.loads(read_frame(self.events.fileno()))
        except EOFError:
            self.proc.join(5)
            status, detail = "error", f"it exited with code {self.proc.exitcode}"
        if status != "ready":
            self.close()
            raise ModelError(f"the generation engine for {export_dir} did not start: {detail}")

    async def attach(self, protocol: _Messages) -> None:
        loop = asyncio.get_running_loop()
        # Duplicate descriptors: each transport closes its own, each Connection its own.
        events = os.fdopen(os.dup(self.events.fileno()), "rb", buffering=0)
        commands = os.fdopen(os.dup(self.commands.fileno()), "wb", buffering=0)
        self.reader, self.protocol = (
            (await loop.connect_read_pipe(lambda: protocol, events))[0],
            protocol,
        )
        self.writer, _ = await loop.connect_write_pipe(asyncio.Protocol, commands)

    def send(self, message: tuple[Any, ...]) -> None:
        if self.writer is None or self.writer.is_closing():
            return  # the process is gone; its death fails the requests it had
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(frame(data))

    def detach(self) -> None:
        """Ask the process to stop and close the loop's transports (on the event loop: they
        belong to it). Closing the writer sends what it holds first."""
        if self.protocol is not None:
            self.protocol.on_lost = None  # closing on purpose is not a death
        self.send(("stop",))
        for transport in (self.writer, self.reader):
            if transport is not None:
                transport.close()
        self.writer = self.reader = None

    def close(self, join_s: float = 10.0) -> None:
        """Wait for the process to end (killing it after `join_s`) and close the pipe ends
        (blocking: run it in a thread; `detach` first when it was attached)."""
        self.proc.join(join_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.commands.close()
        self.events.close()


class GenerationService:
    """One text model's engine process, its supervision, and the streams of its requests."""

    def __init__(
        self,
        spec: EngineSpec,
        max_seq_len: int,
        metrics: GenerationMetrics | None = None,
        version: str = "1",
        step_timeout_s: float = 60.0,
        max_waiting: int | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        self.name = spec.name
        self.version = version
        """The model version it serves (the newest when the server started)."""
        self.tokenizer: Tokenizer = spec.tokenizer
        """Text <-> tokens for every text endpoint of this model."""
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.capacity = spec.config.kv_cache_blocks * spec.config.block_size
        self.metrics = metrics
        self.restarts = 0
        self._process: _Process | None = None
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._ready = False
        self._broken: str | None = None
        """Why the last attempt to start an engine process failed (requests fail at once)."""
        self._waiters: list[asyncio.Future[bool]] = []
        self._closing = False
        self._restarting: asyncio.Task[None] | None = None
        self._preemptions_counted = 0
        self.step_timeout_s = step_timeout_s
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s
        self._running = 0
        """Sequences running in the engine at its last report."""
        self._admitted: deque[list[float]] = deque()
        """[when, sequences] admitted by `admit` that have not reached `generate` yet."""
        self._prefix_counted = (0, 0)
        self._progress = time.monotonic()
        """When the engine process last reported a step, or took work while idle."""
        self._watchdog: asyncio.Task[None] | None = None
        if metrics is not None:
            metrics.kv_blocks.labels(self.name).set(spec.config.kv_cache_blocks)

    def is_ready(self) -> bool:
        """An engine process is up and taking requests (false while one is being replaced)."""
        return self._ready and not self._closing

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None while none runs)."""
        return self._process.proc.pid if self._process is not None else None

    @property
    def waiting(self) -> int:
        """Sequences that have no place in the engine yet: queued in it (by its last report, or
        sent since), waiting for an engine process to start, or admitted and not sent yet
        (for at most `ADMISSION_HOLD_S`)."""
        return len(self._streams) - self._running + len(self._waiters) + self._not_started()

    def _not_started(self) -> int:
        expired = time.monotonic() - ADMISSION_HOLD_S
        while self._admitted and self._admitted[0][0] < expired:
            self._admitted.popleft()
        return int(sum(n for _, n in self._admitted))

    def _started(self) -> None:
        """One admitted sequence reached `generate` (the oldest admission's count drops)."""
        if self._admitted:
            self._admitted[0][1] -= 1
            if self._admitted[0][1] <= 0:
                self._admitted.popleft()

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestRefused now for a request the engine could never serve."""
        check_request(prompt, params, self.max_seq_len, self.capacity)

    def admit(self, sequences: int) -> None:
        """Raise QueueFull for a request of `sequences` sequences (its prompts times its n, each
        a sequence in the engine) that would make more than `max_waiting` sequences wait, or
        that alone asks for more (checked when the request arrives)."""
        if self.max_waiting is None:
            return
        if self.waiting + sequences <= self.max_waiting:
            self._admitted.append([time.monotonic(), sequences])
            return
        if self.metrics is not None:
            self.metrics.refused.labels(self.name).inc()
        if sequences > self.max_waiting:
            raise QueueFull(
                f"this request asks for {sequences} sequences (prompts x n), more than model "
                f"{self.name!r} lets wait at once (generation.max_waiting {self.max_waiting}); "
                "send fewer prompts or a smaller n per request."
            )
        raise QueueFull(
            f"{self.waiting} sequences already wait for model {self.name!r} and this request "
            f"adds {sequences} (max_waiting {self.max_waiting}); retry after "
            f"{QueueFull.retry_after_s} s."
        )

    async def start(self) -> None:
        """Start the engine process and wait until it has built its engine."""
        process = await asyncio.to_thread(self._spawn)
        await process.attach(_Messages(self._on_message, self._on_lost))
        self._process = process
        self._preemptions_counted, self._prefix_counted, self._running = 0, (0, 0), 0
        self._ready, self._broken = True, None
        self._progress = time.monotonic()
        if self.metrics is not None:  # a new engine holds nothing (a dead one's gauges go)
            self.metrics.sequences.labels(self.name, "running").set(0)
            self.metrics.sequences.labels(self.name, "waiting").set(0)
            self.metrics.kv_blocks_used.labels(self.name).set(0)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        self._wake(True)

    def _wake(self, up: bool) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(up)

    def _spawn(self) -> _Process:
        process = _Process(self.spec)
        process.wait_ready(self.spec.export_dir)
        return process

    async def close(self) -> None:
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restarting
        if self._process is not None:
            process, self._process = self._process, None
            process.detach()
            await asyncio.to_thread(process.close, 30.0)
        self._fail_all(SHUTTING_DOWN)
        self._wake(False)

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncGenerator[TokenEvent, None]:
        """Token events of one request, ending with the one that has a finish reason ("abort",
        with the reason, when the engine process died, the server is closing or the request's
        deadline passed). Leaving the loop early (a client that went away) aborts the
        sequence in the engine."""
        self._started()
        check_request(prompt, params, self.max_seq_len, self.capacity)
        seq_id = next(self._ids)
        arrived = time.perf_counter()
        if not self._ready:  # a dead engine process is being replaced: wait for the new one
            up = False
            if not self._closing and self._broken is None:
                waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    up = await waiter
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
            if not up:
                yield TokenEvent(
                    seq_id=seq_id, token=None, finish_reason="abort", reason=self._why_not_ready()
                )
                return
        stream = _Stream(asyncio.Queue(), arrived)
        if not self._streams:  # an idle engine reports nothing; its clock starts now
            self._progress = time.monotonic()
        self._streams[seq_id] = stream
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(self.name).inc(len(prompt))
        assert self._process is not None
        self._process.send(("submit", seq_id, prompt, params))
        # The deadline bounds each wait for an event, never the consumer's own awaits between
        # them (a timeout scope across `yield` would cancel whatever the consumer awaits).
        limit = self.request_timeout_s
        try:
            while True:
                left = None if limit is None else max(0.0, arrived + limit - time.perf_counter())
                try:
                    ev = await asyncio.wait_for(stream.events.get(), left)
                except TimeoutError:
                    why = (
                        f"the request did not finish within the server's request_timeout_s of "
                        f"{limit:g} s; ask for fewer tokens or retry later."
                    )
                    yield TokenEvent(seq_id=seq_id, token=None, finish_reason="abort", reason=why)
                    return
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self._streams.pop(seq_id, None)
            if not stream.done and self._process is not None:
                self._process.send(("abort", seq_id))

    def _why_not_ready(self) -> str:
        if self._closing:
            return SHUTTING_DOWN
        return (
            f"the generation engine of model {self.name!r} cannot start ({self._broken}); "
            "the server keeps trying: retry later."
        )

    # Supervision ---------------------------------------------------------------------------
    def _fail_all(self, reason: str) -> None:
        for seq_id in list(self._streams):
            stream = self._streams.pop(seq_id)
            stream.done = True
            stream.events.put_nowait(
                TokenEvent(seq_id=seq_id, token=None, finish_reason="abort", reason=reason)
            )

    def _on_lost(self) -> None:
        """The engine process died: fail its requests now and start another."""
        if self._closing:
            return
        code = None
        if self._process is not None:
            # Its pipe closes as it dies; reaping it is at once (1 s: one that closed its
            # pipe and lives on is killed by `_restart`).
            self._process.proc.join(1.0)
            code = self._process.proc.exitcode
        log.error(
            "the generation engine of model %r died (exit code %s); restarting it", self.name, code
        )
        self._ready = False
        self._fail_all(
            f"the generation engine process of model {self.name!r} died "
            f"({_exit(code)}) while generating this request; it is being restarted: retry."
        )
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.restarts.labels(self.name).inc()
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _watch(self) -> None:
        """Kill an engine process that holds requests but has reported no step for
        `step_timeout_s` (hung: a deadlock, a stopped process); its death replaces it."""
        while not self._closing:
            await asyncio.sleep(min(1.0, self.step_timeout_s / 4))
            process = self._process
            silent = time.monotonic() - self._progress
            if self._ready and self._streams and process and silent > self.step_timeout_s:
                log.error(
                    "the generation engine of model %r reported no step for %.0f s with %d "
                    "requests; killing it",
                    self.name,
                    silent,
                    len(self._streams),
                )
                process.proc.kill()
                self._progress = time.monotonic()

    async def _restart(self) -> None:
        old, self._process = self._process, None
        if old is not None:
            old.detach()
            await asyncio.to_thread(old.close, 5.0)
        delay = 0.5
        while not self._closing:
            try:
                await self.start()
                return
            except Exception as exc:  # noqa: BLE001 - e.g. the export went bad: say why, retry
                why = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                log.error("%s; trying again in %.0f s", why, delay)
                self._broken = why
                self._wake(False)  # waiting requests fail now, with the retry sentence
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)

    # Tokens ---------------------------------------------------------------------------------
    def _on_message(self, message: tuple[Any, ...]) -> None:
        self._progress = time.monotonic()
        if message[0] != "events":
            return
        _, events, stats = message
        self._running = stats.running
        if self.metrics is not None:
            self._observe(self.metrics, stats)
        self._dispatch([TokenEvent(*ev) for ev in events])

    def _observe(self, m: GenerationMetrics, stats: StepStats) -> None:
        name = self.name
        m.sequences.labels(name, "running").set(stats.running)
        m.sequences.labels(name, "waiting").set(stats.waiting)
        m.kv_blocks_used.labels(name).set(stats.blocks_used)
        if stats.preemptions > self._preemptions_counted:
            m.preemptions.labels(name).inc(stats.preemptions - self._preemptions_counted)
            self._preemptions_counted = stats.preemptions
        hits, queries = self._prefix_counted
        m.prefix_hits.labels(name).inc(stats.prefix_hit_tokens - hits)
        m.prefix_queries.labels(name).inc(stats.prefix_query_tokens - queries)
        self._prefix_counted = (stats.prefix_hit_tokens, stats.prefix_query_tokens)
        if stats.batch_size:
            m.batch_size.labels(name).observe(stats.batch_size)
        now = time.perf_counter()
        for seq_id in stats.admitted:
            stream = self._streams.get(seq_id)
            if stream is not None:
                m.queue_time.labels(name).observe(now - stream.submitted)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for ev in events:
            stream = self._streams.get(ev.seq_id)
            if stream is None:
                continue
            if ev.finish_reason is not None:
                stream.done = True
                if m is not None and ev.finish_reason != "abort":
                    m.latency.labels(self.name).observe(now - stream.submitted)
            if m is not None and ev.token is not None:
                if stream.last is None:
                    m.ttft.labels(self.name).observe(now - stream.submitted)
                else:
                    m.itl.labels(self.name).observe(now - stream.last)
                m.tokens.labels(self.name).inc()
            stream.last = now
            stream.events.put_nowait(ev)
