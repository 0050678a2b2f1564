"""`hpcml loadtest URL --llm`: the streaming LLM mode of the load tester (hpcml.serve.llm_loadtest)."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table

from hpcml.cli.common import console, err_console, print_json
from hpcml.errors import ConfigError, WorkFailed


def run_llm_mode(
    url: str,
    model: str,
    rate: float | None,
    duration: float,
    timeout: float,
    lengths: tuple[str, str],
    chat: bool,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    seed: int,
    json_out: bool,
) -> None:
    from hpcml.serve.llm_loadtest import llm_loadtest, parse_lengths

    if rate is None or not (math.isfinite(rate) and rate > 0):
        raise ConfigError("--llm needs --rate R > 0 (Poisson arrivals of streaming requests).")
    for name, value in (
        ("--duration", duration),
        ("--timeout", timeout),
        ("--ttft-slo-ms", ttft_slo_ms),
        ("--itl-slo-ms", itl_slo_ms),
    ):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} {value} must be a positive number.")
    if rate * duration > 100_000:
        raise ConfigError(
            f"--rate {rate:g} for --duration {duration:g} s is {rate * duration:,.0f} requests; "
            "the LLM mode sends at most 100,000 per run."
        )
    prompt_len = parse_lengths(lengths[0], "--prompt-len")
    flag = "--output-len" if ":" in lengths[1] else "--max-tokens"
    output_len = parse_lengths(lengths[1], flag)
    if output_len.hi > 100_000:
        raise ConfigError(f"{flag} {lengths[1]} must stay within 1 to 100,000 tokens.")
    with err_console.status(f"loadtest --llm: {rate:g} requests/s for {duration:g} s"):
        result = llm_loadtest(
            base_url=url,
            model=model,
            rate=rate,
            duration_s=duration,
            prompt_len=prompt_len,
            output_len=output_len,
            chat=chat,
            ttft_slo_ms=ttft_slo_ms,
            itl_slo_ms=itl_slo_ms,
            timeout_s=timeout,
            seed=seed,
        )
    if json_out:
        print_json(result.to_json())
    else:
        _print(result)
    if result.ok == 0:
        raise WorkFailed(f"no streaming request to {url} succeeded (errors: {result.errors}).")


def _print(r: Any) -> None:
    table = Table(
        title=f"loadtest --llm: {r.rate:g} requests/s, {r.duration_s:.1f} s", show_header=False
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests sent / ok", f"{r.sent:,} / {r.ok:,}")
    for status, n in r.errors.items():
        table.add_row(f"errors {status}", f"{n:,}")
    table.add_row("endpoint", r.endpoint)
    table.add_row("prompt / output lengths", f"{r.prompt_lengths} / {r.output_lengths}")
    table.add_row("output tokens/s (server's usage)", f"{r.output_tokens_per_s:,.1f}")
    per = r.output_tokens_per_request
    if per:
        table.add_row("output tokens per request p50 / p99", f"{per['p50']:,.0f} / {per['p99']:,.0f}")
    rows = (("TTFT", r.ttft_ms), ("inter-token", r.itl_ms), ("end-to-end", r.latency_ms))
    for name, values in rows:
        for key in ("p50", "p99"):
            if key in values:
                table.add_row(f"{name} {key}", f"{values[key]:,.1f} ms")
    queue = "not exported by the server" if r.queue_ms is None else f"{r.queue_ms:,.1f} ms"
    table.add_row("queue time (server, mean)", queue)
    obj = r.objective
    table.add_row(
        f"goodput (TTFT <= {obj['ttft_ms']:g} ms, mean ITL <= {obj['mean_itl_ms']:g} ms)",
        f"{r.goodput:,.2f} requests/s",
    )
    console.print(table)
