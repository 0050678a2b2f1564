"""`hpcml loadtest URL --llm`: the streaming LLM mode of the load tester (hpcml.serve.llm_loadtest)."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table

from hpcml.cli.common import console, err_console, print_json
from hpcml.errors import ConfigError, WorkFailed


def parse_range(text: str) -> tuple[int, int]:
    """'16:64' (uniform between the two, inclusive) or '32' (always 32)."""
    try:
        lo, _, hi = text.partition(":")
        pair = (int(lo), int(hi or lo))
    except ValueError:
        pair = (0, -1)
    if not 1 <= pair[0] <= pair[1]:
        raise ConfigError(
            f"--prompt-len {text!r} is not a length range; give LO:HI with 1 <= LO <= HI, or one "
            "length, e.g. 16:64."
        )
    return pair


def run_llm_mode(
    url: str,
    model: str,
    rate: float | None,
    duration: float,
    timeout: float,
    prompt_len: str,
    max_tokens: int,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    seed: int,
    json_out: bool,
) -> None:
    from hpcml.serve.llm_loadtest import llm_loadtest

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
    if not 1 <= max_tokens <= 100_000:
        raise ConfigError(f"--max-tokens {max_tokens} must lie between 1 and 100,000.")
    lengths = parse_range(prompt_len)
    with err_console.status(f"loadtest --llm: {rate:g} requests/s for {duration:g} s"):
        result = llm_loadtest(
            base_url=url,
            model=model,
            rate=rate,
            duration_s=duration,
            prompt_len=lengths,
            max_tokens=max_tokens,
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
    table.add_row("output tokens/s", f"{r.output_tokens_per_s:,.1f}")
    for name, values in (("TTFT", r.ttft_ms), ("inter-token", r.itl_ms), ("latency", r.latency_ms)):
        for key in ("p50", "p99"):
            if key in values:
                table.add_row(f"{name} {key}", f"{values[key]:,.1f} ms")
    obj = r.objective
    table.add_row(
        f"goodput (TTFT <= {obj['ttft_ms']:g} ms, mean ITL <= {obj['mean_itl_ms']:g} ms)",
        f"{r.goodput:,.2f} requests/s",
    )
    console.print(table)
