"""Load generator for Open Inference Protocol servers: open loop (Poisson) and closed loop.

Open loop sends at the times a Poisson process of the target rate draws, whatever the server
does, and measures each latency from the *intended* send time: a stalled server or a late
client shows up as latency instead of silently lowering the rate (no coordinated omission).
Closed loop runs C clients that each send their next request when the last one returns.
Latencies go into an HdrHistogram (1 us .. 10 min, 3 significant digits): successes in
`latency_ms`, and every request that got an answer or gave up (errors, client timeouts at the
time they gave up) in `latency_all_ms` and `error_latency_ms`, so failures never vanish from
the percentiles. A request the client could not send (too many in flight) counts in `not_sent`,
not in `sent` or `achieved_rate`. `processes=N` splits the load over N client processes (each
its own event loop) and merges their histograms, for rates one loop cannot drive.

The HTTP client is aiohttp: on these CPUs httpx spends about 10x more CPU per request, which
the load generator would take from the server under test.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hpcml.errors import ConfigError, WorkFailed

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
_SPECTRUM = (0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 100.0)
_MAX_TIMELINE = 20_000


@dataclass
class LoadtestResult:
    mode: str
    url: str
    duration_s: float
    target_rate: float | None
    concurrency: int | None
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    not_sent: int = 0
    """Open loop: requests due while `max_inflight` were outstanding, never sent."""
    processes: int = 1
    achieved_rate: float = 0.0
    """Requests actually sent per second (open loop: compare with target_rate)."""
    throughput: float = 0.0
    """Successful responses per second."""
    latency_ms: dict[str, float] = field(default_factory=dict)
    """Successful requests only."""
    latency_all_ms: dict[str, float] = field(default_factory=dict)
    """Every sent request: successes, errors and timeouts (at the time the client gave up)."""
    error_latency_ms: dict[str, float] = field(default_factory=dict)
    """Failed requests (error statuses, client timeouts, connection errors)."""
    spectrum_ms: dict[str, float] = field(default_factory=dict)
    send_lag_ms_p99: float = 0.0
    """How late the client sent (open loop); large values mean the client, not the server, lagged."""
    valid: bool = True
    """False when the client fell behind its schedule (open loop: send lag p99 over
    `max_send_lag_ms`): the latencies then measure the load generator, not the server."""
    invalid_reason: str | None = None
    timeline: list[tuple[float, float, int]] = field(default_factory=list)
    """(seconds since start, latency ms, status) for up to 20k requests, for plots."""

    def to_json(self, with_timeline: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_timeline:
            d.pop("timeline")
        return d


class _Recorder:
    def __init__(self) -> None:
        from hdrh.histogram import HdrHistogram

        self.hist = HdrHistogram(1, 600_000_000, 3)  # microseconds
        self.all = HdrHistogram(1, 600_000_000, 3)
        self.failed = HdrHistogram(1, 600_000_000, 3)
        self.lag = HdrHistogram(1, 600_000_000, 3)
        self.ok = 0
        self.sent = 0
        self.not_sent = 0
        self.elapsed = 0.0
        self.errors: dict[str, int] = {}
        self.timeline: list[tuple[float, float, int]] = []
        self._rng = random.Random(0)
        self._seen = 0

    def record(self, t_rel_s: float, latency_s: float, status: int | str) -> None:
        us = max(1, int(latency_s * 1e6))
        self.all.record_value(us)
        if status == 200:
            self.ok += 1
            self.hist.record_value(us)
        else:
            key = str(status)
            self.errors[key] = self.errors.get(key, 0) + 1
            self.failed.record_value(us)
        # Reservoir sample: the plot shows the whole run, not its first 20k requests.
        self._seen += 1
        point = (
            round(t_rel_s, 4),
            round(latency_s * 1e3, 3),
            status if isinstance(status, int) else 0,
        )
        if len(self.timeline) < _MAX_TIMELINE:
            self.timeline.append(point)
        else:
            j = self._rng.randrange(self._seen)
            if j < _MAX_TIMELINE:
                self.timeline[j] = point


async def fetch_payload(
    session: Any,
    base_url: str,
    model: str,
    version: str | None,
    batch: int,
    binary: bool = False,
) -> tuple[bytes, dict[str, str]]:
    """A random request body that fits the model's signature, read from its metadata, and its
    headers: JSON, or with `binary` the binary tensor extension (what tritonclient sends)."""
    from hpcml.serve.codec.oip import DATATYPES, encode_binary_request, encode_request_bytes

    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
    try:
        async with session.get(base_url + path) as resp:
            meta = await resp.json(content_type=None)
            status = resp.status
    except Exception as exc:  # noqa: BLE001 - any connection problem is one user-facing error
        raise WorkFailed(
            f"cannot reach {base_url}{path} ({type(exc).__name__}); is the server running?"
        ) from None
    if status != 200:
        raise ConfigError(f"{base_url}{path} answered {status}: {meta.get('error', meta)}")
    spec = meta["inputs"][0]
    shape = [batch, *[d for d in spec["shape"][1:]]]
    dtype = DATATYPES[spec["datatype"]]
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.floating):
        x = rng.standard_normal(shape).astype(dtype)
    else:
        x = np.zeros(shape, dtype=dtype)
    if not binary:
        return encode_request_bytes(x, spec["name"]), {}
    return encode_binary_request(x, spec["name"])


async def _send(
    session: Any, url: str, body: bytes, headers: dict[str, str], timeout_s: float
) -> int | str:
    import aiohttp

    try:
        async with session.post(
            url,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            await resp.read()
            return int(resp.status)
    except TimeoutError:
        return "client_timeout"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def run_loadtest(
    base_url: str,
    model: str,
    duration_s: float,
    rate: float | None = None,
    concurrency: int | None = None,
    version: str | None = None,
    batch: int = 1,
    payload: bytes | None = None,
    infer_path: str | None = None,
    timeout_s: float = 30.0,
    max_inflight: int = 4096,
    seed: int = 0,
    progress: Callable[[float, int, int, int], None] | None = None,
    recorder: _Recorder | None = None,
    headers: dict[str, str] | None = None,
    max_send_lag_ms: float = 10.0,
    binary: bool = False,
    grpc_target: str | None = None,
) -> LoadtestResult:
    """Drive `base_url` for `duration_s`; exactly one of `rate` (open) or `concurrency` (closed).

    `headers` are added to every request (they override the JSON content-type), e.g. the
    binary tensor extension's `Inference-Header-Content-Length` for a binary `payload`. Without
    a `payload`, one is built from the model's metadata: JSON, or binary tensor data with
    `binary`. With `grpc_target` (HOST:PORT) the requests go to the gRPC endpoint instead
    (ModelInfer with raw contents), built from the same body."""
    import aiohttp

    if (rate is None) == (concurrency is None):
        raise ConfigError("give exactly one of --rate (open loop) or --concurrency (closed loop).")
    if rate is not None and rate <= 0:
        raise ConfigError(f"--rate {rate} must be positive (requests per second).")
    if concurrency is not None and concurrency <= 0:
        raise ConfigError(f"--concurrency {concurrency} must be positive.")
    if duration_s <= 0:
        raise ConfigError(f"--duration {duration_s} must be positive (seconds).")
    _check_max_lag(max_send_lag_ms)
    base_url = base_url.rstrip("/")
    path = infer_path or (
        f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    )
    url = base_url + path
    send_headers = {"content-type": "application/json", **(headers or {})}
    rec = recorder if recorder is not None else _Recorder()
    limit = concurrency if concurrency is not None else max_inflight
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        if payload is not None:
            body = payload
        else:
            body, built = await fetch_payload(session, base_url, model, version, batch, binary)
            send_headers.update(built)
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05
        end = start + duration_s

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.25)
                if progress is not None:
                    progress(
                        min(loop.time() - start, duration_s),
                        rec.sent,
                        rec.ok,
                        sum(rec.errors.values()),
                    )

        channel = None
        if grpc_target is not None:
            from hpcml.serve.loadtest_grpc import grpc_sender

            send, channel = grpc_sender(grpc_target, model, version, body, send_headers, timeout_s)
            url = f"grpc://{grpc_target}/{model}"
        else:

            async def send() -> int | str:
                return await _send(session, url, body, send_headers, timeout_s)

        tick = asyncio.create_task(ticker())
        try:
            if rate is not None:
                await _open_loop(send, rate, start, end, max_inflight, seed, rec)
            else:
                assert concurrency is not None
                await _closed_loop(send, concurrency, start, end, rec)
        finally:
            tick.cancel()
            if channel is not None:
                await channel.close()
        elapsed = max(loop.time() - start, 1e-9)
        rec.elapsed = elapsed
    if progress is not None:
        progress(duration_s, rec.sent, rec.ok, sum(rec.errors.values()))
    return _result(rec, url, duration_s, rate, concurrency, elapsed, 1, max_send_lag_ms)


def _summary(h: Any) -> dict[str, float]:
    if not h.get_total_count():
        return {}
    return {
        **{f"p{p:g}": h.get_value_at_percentile(p) / 1e3 for p in PERCENTILES},
        "mean": h.get_mean_value() / 1e3,
        "max": h.get_max_value() / 1e3,
        "min": h.get_min_value() / 1e3,
        "count": float(h.get_total_count()),
    }


def _result(
    rec: _Recorder,
    url: str,
    duration_s: float,
    rate: float | None,
    concurrency: int | None,
    elapsed: float,
    processes: int = 1,
    max_send_lag_ms: float = 10.0,
) -> LoadtestResult:
    result = LoadtestResult(
        mode="open" if rate is not None else "closed",
        url=url,
        duration_s=duration_s,
        target_rate=rate,
        concurrency=concurrency,
        sent=rec.sent,
        ok=rec.ok,
        errors=dict(sorted(rec.errors.items())),
        not_sent=rec.not_sent,
        processes=processes,
        achieved_rate=rec.sent / duration_s,
        throughput=rec.ok / elapsed,
        timeline=rec.timeline,
        latency_ms=_summary(rec.hist),
        latency_all_ms=_summary(rec.all),
        error_latency_ms=_summary(rec.failed),
    )
    h = rec.hist
    if h.get_total_count():
        result.spectrum_ms = {f"{p:g}": h.get_value_at_percentile(p) / 1e3 for p in _SPECTRUM}
    if rec.lag.get_total_count():
        result.send_lag_ms_p99 = rec.lag.get_value_at_percentile(99.0) / 1e3
        if result.send_lag_ms_p99 > max_send_lag_ms:
            result.valid = False
            result.invalid_reason = (
                f"the client sent late (send lag p99 {result.send_lag_ms_p99:.3g} ms > "
                f"{max_send_lag_ms:g} ms): it, not the server, set the latencies; use more "
                "--processes, fewer cores for the server, or a lower rate."
            )
    return result


async def _open_loop(
    send: Callable[[], Awaitable[int | str]],
    rate: float,
    start: float,
    end: float,
    max_inflight: int,
    seed: int,
    rec: _Recorder,
) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    inflight: set[asyncio.Task[None]] = set()

    async def one(intended: float) -> None:
        rec.lag.record_value(max(1, int((loop.time() - intended) * 1e6)))
        status = await send()
        rec.record(intended - start, loop.time() - intended, status)

    intended = start
    while True:
        intended += rng.expovariate(rate)
        if intended >= end:
            break
        delay = intended - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(inflight) >= max_inflight:
            # The client would need unbounded memory to keep the schedule: count it as not
            # sent (it is not in `sent`, `achieved_rate` or the latency percentiles).
            rec.not_sent += 1
            continue
        rec.sent += 1
        task = asyncio.create_task(one(intended))
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    if inflight:
        await asyncio.gather(*inflight)


async def _closed_loop(
    send: Callable[[], Awaitable[int | str]],
    concurrency: int,
    start: float,
    end: float,
    rec: _Recorder,
) -> None:
    loop = asyncio.get_running_loop()

    async def client(i: int) -> None:
        # Stagger starts over 10 ms so the first requests do not land as one burst.
        await asyncio.sleep(max(0.0, start - loop.time()) + 0.01 * i / concurrency)
        while (sent_at := loop.time()) < end:
            rec.sent += 1
            status = await send()
            rec.record(sent_at - start, loop.time() - sent_at, status)

    await asyncio.gather(*(client(i) for i in range(concurrency)))


def _check_max_lag(max_send_lag_ms: float) -> None:
    if not math.isfinite(max_send_lag_ms) or max_send_lag_ms <= 0:
        raise ConfigError(
            f"--max-send-lag-ms {max_send_lag_ms} must be a positive number of milliseconds."
        )


def loadtest(processes: int = 1, **kwargs: Any) -> LoadtestResult:
    """Synchronous `run_loadtest` (its own event loop); `processes > 1` splits the rate (or the
    clients) over that many client processes and merges what they measured."""
    _check_max_lag(float(kwargs.get("max_send_lag_ms", 10.0)))
    if processes <= 1:
        return asyncio.run(run_loadtest(**kwargs))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rate, concurrency = kwargs.get("rate"), kwargs.get("concurrency")
    if concurrency is not None and concurrency < processes:
        raise ConfigError(
            f"--concurrency {concurrency} is smaller than --processes {processes}; give each "
            "process at least one client."
        )
    shares = []
    for i in range(processes):
        share = dict(kwargs, seed=int(kwargs.get("seed", 0)) + i, progress=None)
        if rate is not None:
            share["rate"] = rate / processes
        if concurrency is not None:
            share["concurrency"] = concurrency // processes + (i < concurrency % processes)
        shares.append(share)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        parts = list(pool.map(_loadtest_part, shares))
    rec = _Recorder()
    for part in parts:
        for name in ("hist", "all", "failed", "lag"):
            getattr(rec, name).decode_and_add(part[name])
        rec.ok += part["ok"]
        rec.sent += part["sent"]
        rec.not_sent += part["not_sent"]
        for key, n in part["errors"].items():
            rec.errors[key] = rec.errors.get(key, 0) + n
        rec.timeline.extend(part["timeline"][: _MAX_TIMELINE // processes])
    elapsed = max(p["elapsed"] for p in parts)
    first = parts[0]
    max_lag = float(kwargs.get("max_send_lag_ms", 10.0))
    duration_s = kwargs["duration_s"]
    return _result(rec, first["url"], duration_s, rate, concurrency, elapsed, processes, max_lag)


def _loadtest_part(kwargs: dict[str, Any]) -> dict[str, Any]:
    """One client process of a multi-process load test: its counts and encoded histograms."""
    rec = _Recorder()
    result = asyncio.run(run_loadtest(recorder=rec, **kwargs))
    return {
        "url": result.url,
        "hist": rec.hist.encode(),
        "all": rec.all.encode(),
        "failed": rec.failed.encode(),
        "lag": rec.lag.encode(),
        "ok": rec.ok,
        "sent": rec.sent,
        "not_sent": rec.not_sent,
        "errors": rec.errors,
        "timeline": rec.timeline,
        "elapsed": rec.elapsed,
    }


def wait_ready(base_url: str, timeout_s: float = 60.0) -> None:
    """Block until GET /v2/health/ready answers 200 (used by benchmarks and scripts)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                base_url.rstrip("/") + "/v2/health/ready", timeout=2
            ) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise WorkFailed(f"{base_url} did not become ready within {timeout_s:g} s.")
