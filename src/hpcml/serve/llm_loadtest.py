"""`hpcml loadtest --llm`: load on an OpenAI-compatible `/v1/completions` endpoint with
streaming clients, as LLM serving is judged: time to first token (TTFT), inter-token latency
(ITL), output tokens/s and goodput under a latency objective.

Open loop: Poisson arrivals at `rate` requests/s for `duration_s` (seeded), each a prompt of
a length drawn uniformly from `prompt_len` (printable ASCII characters: one byte-level token
each), `stream: true`, greedy. Per request the client records when it sent, when the first
text arrived, and when every later server-sent event arrived; ITL is the gap between
consecutive events (as the streaming client sees it: an event can carry more than one token
when a character spans several bytes). Output tokens of a request: `max_tokens` when it
finished for length, else the UTF-8 bytes of its text (the byte-level models' tokens).
Goodput counts the requests, per second, whose TTFT and mean ITL both meet the objective
(the definition of DistServe, Zhong et al. 2024). Errors, timeouts and streams that broke
off are counted beside the successes, never dropped.

Hand-written because the field's LLM load generators (vLLM's `benchmark_serving`, GenAI-Perf)
are scripts of large packages (vLLM, Triton's SDK container), not libraries to import here.
"""

from __future__ import annotations

import asyncio
import json
import string
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

ALPHABET = (string.ascii_letters + string.digits + " .,;:()[]=+-*/_\n").encode()


@dataclass
class StreamRecord:
    prompt_len: int
    sent_s: float
    first_s: float | None = None
    events: list[float] = field(default_factory=list)
    tokens: int = 0
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
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]
    goodput: float
    """requests/s meeting both objectives."""
    objective: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1e3
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def prompts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    table = np.frombuffer(ALPHABET, dtype=np.uint8)
    return [rng.choice(table, size=int(k)).astype(np.uint8).tobytes().decode() for k in lengths]


async def _one(
    client: Any, url: str, body: dict[str, Any], rec: StreamRecord, max_tokens: int
) -> None:
    text, finish = "", None
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
                choice = event["choices"][0]
                now = time.perf_counter()
                if choice.get("text"):
                    rec.first_s = rec.first_s or now
                    rec.events.append(now)
                    text += choice["text"]
                finish = choice.get("finish_reason") or finish
    except Exception as exc:  # noqa: BLE001 - every failure is a counted outcome
        rec.status = type(exc).__name__
        return
    if finish is None:
        rec.status = "stream ended early"
        return
    rec.tokens = max_tokens if finish == "length" else len(text.encode())


async def run_llm_loadtest(
    base_url: str,
    model: str,
    rate: float,
    duration_s: float,
    prompt_len: tuple[int, int] = (16, 64),
    max_tokens: int = 32,
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
    texts = prompts(len(arrivals), prompt_len[0], prompt_len[1], seed + 1)
    url = base_url.rstrip("/") + "/v1/completions"
    records: list[StreamRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for at, text in zip(arrivals, texts, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = StreamRecord(len(text), time.perf_counter())
            records.append(rec)
            body = {
                "model": model,
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            tasks.append(asyncio.create_task(_one(client, url, body, rec, max_tokens)))
        await asyncio.gather(*tasks)
        elapsed = max(duration_s, time.perf_counter() - start)
    return _result(base_url, rate, elapsed, records, ttft_slo_ms, itl_slo_ms)


def _result(
    url: str,
    rate: float,
    elapsed: float,
    records: list[StreamRecord],
    ttft_slo_ms: float,
    itl_slo_ms: float,
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
        ttft_ms=_pct([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=_pct([g for r in ok for g in r.gaps]),
        latency_ms=_pct([r.events[-1] - r.sent_s for r in ok if r.events]),
        goodput=sum(1 for r in ok if good(r)) / elapsed,
        objective={"ttft_ms": ttft_slo_ms, "mean_itl_ms": itl_slo_ms},
    )


def llm_loadtest(**kwargs: Any) -> LlmLoadResult:
    return asyncio.run(run_llm_loadtest(**kwargs))
