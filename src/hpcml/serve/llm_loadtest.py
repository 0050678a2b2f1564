"""`hpcml loadtest --llm`: load on an OpenAI-compatible `/v1/completions` or
`/v1/chat/completions` endpoint with streaming clients, as LLM serving is judged: time to first
token (TTFT), inter-token latency (ITL), end-to-end latency, queue time, output tokens/s and
goodput under a latency objective.

Open loop: Poisson arrivals at `rate` requests/s for `duration_s` (seeded), each a prompt of
printable ASCII characters (one byte-level token each; a BPE model makes fewer tokens of
them) and a `max_tokens`, both lengths drawn (seeded) from a `Lengths` distribution: fixed,
uniform, or lognormal (ShareGPT's conversations have long-tailed lengths), `stream: true`,
greedy. Per request the client records when it sent, when the first text arrived, and when
every later server-sent event arrived; ITL is the gap between consecutive events (as the
streaming client sees it: an event can carry more than one token when a character spans
several bytes); end-to-end latency runs from sending to the last event. Tokens, prompt and
output, are the server's own count: every request asks for `stream_options.include_usage` and
reads the `usage` of the stream's last chunk (a stream without one is counted as the error
"no usage"). Queue time (arrival to admission into the engine) is the server's: the mean of its
`hpcml_llm_queue_time_seconds` histogram over the run, read from its `/metrics`, when it has
one. Goodput counts the requests, per second, whose TTFT and mean ITL both meet the
objective (the definition of DistServe, Zhong et al. 2024). Errors, timeouts and streams that
broke off are counted beside the successes, never dropped.

Hand-written because the field's LLM load generators (vLLM's `benchmark_serving`, GenAI-Perf)
are scripts of large packages (vLLM, Triton's SDK container), not libraries to import here.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import string
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hpcml.errors import ConfigError

ALPHABET = (string.ascii_letters + string.digits + " .,;:()[]=+-*/_\n").encode()


@dataclass(frozen=True)
class Lengths:
    """Token lengths: `fixed` (lo), `uniform` (lo..hi inclusive), or `lognormal` (median lo,
    log-space standard deviation sigma, rounded and clipped to 1..hi)."""

    kind: str
    lo: int
    hi: int
    sigma: float = 0.0

    def draw(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.lo, self.hi + 1, size=n)]
        if self.kind == "lognormal":
            x = np.rint(rng.lognormal(math.log(self.lo), self.sigma, size=n))
            return [int(v) for v in np.clip(x, 1, self.hi)]
        return [self.lo] * n

    def describe(self) -> str:
        if self.kind == "lognormal":
            return f"lognormal(median {self.lo}, sigma {self.sigma:g}, max {self.hi})"
        return f"uniform {self.lo}..{self.hi}" if self.kind == "uniform" else f"{self.lo}"


LENGTHS_HELP = "N (always N), LO:HI (uniform) or lognormal:MEDIAN:SIGMA:MAX"


def parse_lengths(text: str, flag: str) -> Lengths:
    """`N`, `LO:HI` or `lognormal:MEDIAN:SIGMA:MAX`; ConfigError naming `flag` otherwise."""
    m = re.fullmatch(r"lognormal:(\d+):([0-9.]+):(\d+)", text.strip())
    if m:
        median, sigma, hi = int(m[1]), float(m[2]), int(m[3])
        if 1 <= median <= hi and 0 < sigma <= 4:
            return Lengths("lognormal", median, hi, sigma)
    else:
        lo, _, hi_text = text.partition(":")
        try:
            pair = (int(lo), int(hi_text or lo))
        except ValueError:
            pair = (0, -1)
        if 1 <= pair[0] <= pair[1]:
            return Lengths("uniform" if pair[1] > pair[0] else "fixed", *pair)
    raise ConfigError(
        f"{flag} {text!r} is not a length distribution; give {LENGTHS_HELP} with 1 <= LO <= HI "
        "(MEDIAN <= MAX, 0 < SIGMA <= 4), e.g. 16:64 or lognormal:64:1.0:512."
    )


@dataclass
class StreamRecord:
    prompt_len: int
    sent_s: float
    max_tokens: int = 0
    first_s: float | None = None
    events: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    status: str = "ok"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:], strict=False)]


@dataclass
class LlmLoadResult:
    url: str
    rate: float
    duration_s: float
    sent: int
    ok: int
    errors: dict[str, int]
    output_tokens: int
    output_tokens_per_s: float
    prompt_tokens: int
    endpoint: str
    prompt_lengths: str
    output_lengths: str
    output_tokens_per_request: dict[str, float]
    """Percentiles of the output tokens the server reported per request."""
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]
    """End to end: from sending a request to its last event."""
    queue_ms: float | None
    """Mean queue time by the server's histogram over the run (None: it exports none)."""
    goodput: float
    """requests/s meeting both objectives."""
    objective: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * scale
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def prompts(n: int, lengths: Lengths, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    table = np.frombuffer(ALPHABET, dtype=np.uint8)
    return [
        rng.choice(table, size=k).astype(np.uint8).tobytes().decode()
        for k in lengths.draw(n, rng)
    ]


QUEUE = re.compile(r'^hpcml_llm_queue_time_seconds_(sum|count)\{model="([^"]*)"\} (\S+)$', re.M)


async def queue_totals(client: Any, base_url: str, model: str) -> tuple[float, float] | None:
    """(sum, count) of the server's queue-time histogram for `model`; None without one."""
    try:
        text = (await client.get(base_url.rstrip("/") + "/metrics")).text
    except Exception:  # noqa: BLE001 - a server without /metrics has no queue time to give
        return None
    return parse_queue(text, model)


def parse_queue(text: str, model: str) -> tuple[float, float] | None:
    """(sum, count) of `model`'s queue-time histogram in a Prometheus text exposition."""
    found = {kind: float(v) for kind, name, v in QUEUE.findall(text) if name == model}
    return (found["sum"], found["count"]) if len(found) == 2 else None


async def _one(client: Any, url: str, body: dict[str, Any], rec: StreamRecord) -> None:
    chat, finish, usage = "messages" in body, None, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.status = str(resp.status_code)
                await resp.aread()
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.status = "stream error"
                    return
                usage = event.get("usage") or usage
                if not event.get("choices"):
                    continue  # the usage chunk
                choice = event["choices"][0]
                now = time.perf_counter()
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    rec.first_s = rec.first_s or now
                    rec.events.append(now)
                finish = choice.get("finish_reason") or finish
    except Exception as exc:  # noqa: BLE001 - every failure is a counted outcome
        rec.status = type(exc).__name__
        return
    if finish is None:
        rec.status = "stream ended early"
    elif usage is None:
        rec.status = "no usage"
    else:
        rec.tokens, rec.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]


async def run_llm_loadtest(
    base_url: str,
    model: str,
    rate: float,
    duration_s: float,
    prompt_len: Lengths = Lengths("uniform", 16, 64),
    output_len: Lengths = Lengths("fixed", 32, 32),
    chat: bool = False,
    ttft_slo_ms: float = 1000.0,
    itl_slo_ms: float = 100.0,
    timeout_s: float = 60.0,
    seed: int = 0,
) -> LlmLoadResult:
    import httpx

    rng = np.random.default_rng(seed)
    arrivals: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < duration_s:
        arrivals.append(t)
        t += float(rng.exponential(1.0 / rate))
    texts = prompts(len(arrivals), prompt_len, seed + 1)
    outputs = output_len.draw(len(arrivals), np.random.default_rng(seed + 2))
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    records: list[StreamRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        queued = await queue_totals(client, base_url, model)
        start = time.perf_counter()
        tasks = []
        for at, text, n in zip(arrivals, texts, outputs, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = StreamRecord(len(text), time.perf_counter(), n)
            records.append(rec)
            body: dict[str, Any] = {
                "model": model,
                "max_tokens": n,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            tasks.append(asyncio.create_task(_one(client, url, body, rec)))
        await asyncio.gather(*tasks)
        elapsed = max(duration_s, time.perf_counter() - start)
        after = await queue_totals(client, base_url, model)
    queue_ms = None
    if queued is not None and after is not None and after[1] > queued[1]:
        queue_ms = (after[0] - queued[0]) / (after[1] - queued[1]) * 1e3
    shape = {
        "endpoint": "chat" if chat else "completions",
        "prompt_lengths": prompt_len.describe(),
        "output_lengths": output_len.describe(),
        "queue_ms": queue_ms,
    }
    return _result(base_url, rate, elapsed, records, ttft_slo_ms, itl_slo_ms, shape)


def _result(
    url: str,
    rate: float,
    elapsed: float,
    records: list[StreamRecord],
    ttft_slo_ms: float,
    itl_slo_ms: float,
    shape: dict[str, Any],
) -> LlmLoadResult:
    ok = [r for r in records if r.status == "ok"]
    errors: dict[str, int] = {}
    for r in records:
        if r.status != "ok":
            errors[r.status] = errors.get(r.status, 0) + 1

    def good(r: StreamRecord) -> bool:
        ttft = r.ttft_s
        mean_itl = float(np.mean(r.gaps)) if r.gaps else 0.0
        return ttft is not None and ttft * 1e3 <= ttft_slo_ms and mean_itl * 1e3 <= itl_slo_ms

    tokens = sum(r.tokens for r in ok)
    return LlmLoadResult(
        url=url,
        rate=rate,
        duration_s=elapsed,
        sent=len(records),
        ok=len(ok),
        errors=errors,
        output_tokens=tokens,
        output_tokens_per_s=tokens / elapsed,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens_per_request=_pct([r.tokens for r in ok], scale=1.0),
        ttft_ms=_pct([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=_pct([g for r in ok for g in r.gaps]),
        latency_ms=_pct([r.events[-1] - r.sent_s for r in ok if r.events]),
        goodput=sum(1 for r in ok if good(r)) / elapsed,
        objective={"ttft_ms": ttft_slo_ms, "mean_itl_ms": itl_slo_ms},
        **shape,
    )


def llm_loadtest(**kwargs: Any) -> LlmLoadResult:
    return asyncio.run(run_llm_loadtest(**kwargs))
