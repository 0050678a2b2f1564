"""One served text model: its engine stepping in a thread of its own, and token streams to the
event loop.

The event loop never touches the engine: requests and cancellations go to the engine thread
through an inbox it drains before every step, and each generated token comes back to the
request's `asyncio.Queue` with `call_soon_threadsafe`. The thread sleeps on the inbox while
there is no work. Metrics (Prometheus, in the server's registry): time to first token,
inter-token latency, output tokens, preemptions, running and waiting sequences, KV blocks used.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hpcml.models.gpt import GPT
from hpcml.serve.generate.engine import Engine, EngineConfig, TokenEvent
from hpcml.serve.generate.sampling import ByteTokenizer, SamplingParams, Tokenizer

log = logging.getLogger(__name__)

TOKEN_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "hpcml_llm_time_to_first_token_seconds",
            "From a completion request's arrival to its first generated token.",
            ["model"],
            buckets=TOKEN_BUCKETS_S,
            registry=registry,
        )
        self.itl = Histogram(
            "hpcml_llm_inter_token_latency_seconds",
            "Between two consecutive generated tokens of one request.",
            ["model"],
            buckets=TOKEN_BUCKETS_S,
            registry=registry,
        )
        self.tokens = Counter(
            "hpcml_llm_output_tokens", "Generated tokens.", ["model"], registry=registry
        )
        self.preemptions = Counter(
            "hpcml_llm_preemptions",
            "Sequences preempted for KV blocks (recomputed later).",
            ["model"],
            registry=registry,
        )
        self.sequences = Gauge(
            "hpcml_llm_sequences",
            "Sequences in the engine, by state (running, waiting).",
            ["model", "state"],
            registry=registry,
        )
        self.kv_blocks_used = Gauge(
            "hpcml_llm_kv_cache_blocks_used",
            "KV cache blocks in use.",
            ["model"],
            registry=registry,
        )
        self.kv_blocks = Gauge(
            "hpcml_llm_kv_cache_blocks", "KV cache blocks in all.", ["model"], registry=registry
        )


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent]
    submitted: float
    last: float | None = None
    tokens: int = 0
    done: bool = False


class GenerationService:
    def __init__(
        self,
        name: str,
        model: GPT,
        config: EngineConfig,
        metrics: GenerationMetrics | None = None,
        version: str = "1",
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.name = name
        self.version = version
        """The model version it serves (the newest when the server started)."""
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        """Text <-> tokens for every text endpoint of this model (UTF-8 bytes by default)."""
        self.engine = Engine(model, config, self.tokenizer)
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._preemptions_counted = 0
        if metrics is not None:
            metrics.kv_blocks.labels(name).set(config.kv_cache_blocks)

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestRefused now for a request the engine could never serve."""
        self.engine.check(prompt, params)

    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, name=f"hpcml-llm-{self.name}", daemon=True
        )
        self._thread.start()

    async def close(self) -> None:
        self._stop = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncGenerator[TokenEvent, None]:
        """Token events of one request, ending with the one that has a finish reason. Leaving
        the loop early (a client that went away) aborts the sequence in the engine."""
        self.check(prompt, params)
        seq_id = next(self._ids)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        self._streams[seq_id] = stream
        self._inbox.put(("submit", (seq_id, prompt, params)))
        try:
            while True:
                ev = await stream.events.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not stream.done:
                self._inbox.put(("abort", seq_id))
            self._streams.pop(seq_id, None)

    # The engine thread ---------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            kind, arg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if kind == "submit":
                    seq_id, prompt, params = arg
                    try:
                        self.engine.submit(prompt, params, seq_id)
                    except ValueError:  # checked on the loop already; never expected here
                        self._dispatch([TokenEvent(seq_id, None, "abort")])
                elif kind == "abort":
                    self.engine.abort(arg)
                kind, arg = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _run(self) -> None:
        while not self._stop:
            self._drain(block=not self.engine.has_work)
            if not self.engine.has_work:
                continue
            try:
                events = self.engine.step()
            except Exception:  # a bug of ours: fail the running requests, keep serving
                log.exception("generation step of model %r failed", self.name)
                events = [TokenEvent(s.id, None, "abort") for s in self.engine.running]
                for ev in events:
                    self.engine.abort(ev.seq_id)
            self._dispatch(events)
        for seq_id, stream in list(self._streams.items()):
            stream.loop.call_soon_threadsafe(
                stream.events.put_nowait, TokenEvent(seq_id, None, "abort")
            )

    def _dispatch(self, events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for ev in events:
            stream = self._streams.get(ev.seq_id)
            if stream is None:
                continue
            if ev.finish_reason is not None:
                stream.done = True
            if m is not None and ev.token is not None:
                if stream.last is None:
                    m.ttft.labels(self.name).observe(now - stream.submitted)
                else:
                    m.itl.labels(self.name).observe(now - stream.last)
                m.tokens.labels(self.name).inc()
            stream.last = now
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, ev)
        if m is not None:
            e = self.engine
            m.sequences.labels(self.name, "running").set(len(e.running))
            m.sequences.labels(self.name, "waiting").set(len(e.waiting))
            m.kv_blocks_used.labels(self.name).set(e.blocks_used)
            if e.preemptions > self._preemptions_counted:
                m.preemptions.labels(self.name).inc(e.preemptions - self._preemptions_counted)
                self._preemptions_counted = e.preemptions
