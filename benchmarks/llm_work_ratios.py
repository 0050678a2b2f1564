"""Static batching's work over continuous batching's on the long-tailed workload (for
llm_step_profile.py): from the workload's draws (positions and FLOPs are `llm_serving_http`'s),
for one run's requests, and from a fitted step cost; and the comparison at equal p99
inter-token latency of a profile's saturated runs."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
from llm_serving_http import WORKLOADS

Request = tuple[float, list[int], int]


def draws(seed: int) -> tuple[np.ndarray, np.ndarray]:
    prompt, output = WORKLOADS["long-tailed"]
    rng = np.random.default_rng(seed)
    return np.array(prompt.draw(4096, rng)), np.array(output.draw(4096, rng))


def fitted_ratio(fit: dict[str, float], batch: int, seed: int) -> float:
    """Static / continuous seconds at saturation from a fit: static runs each batch for its
    longest output (padding rows for the finished), continuous keeps `batch` decoding."""
    p, o = draws(seed)
    f, dec, tok, pad = (fit[k] for k in ("fixed", "decode", "prompt_token", "padding"))
    continuous = (o.sum() / batch) * f + (o.sum() - len(o)) * dec + p.sum() * tok
    static = 0.0
    for i in range(0, len(o), batch):
        chunk = o[i : i + batch]
        longest = int(chunk.max())
        static += (
            longest * f
            + (chunk - 1).sum() * dec
            + (len(chunk) * (longest - 1) - (chunk - 1).sum()) * pad
        )
    static += p.sum() * tok
    return float(static / continuous)


def steps_ratio(batch: int, seed: int) -> float:
    """Static's decode steps over continuous's in saturated batches of `batch`: the ratio
    where a step costs the same whatever its rows (prefill left out)."""
    _, o = draws(seed)
    static = sum(int(o[i : i + batch].max()) for i in range(0, len(o), batch))
    return float(static / (o.sum() / batch))


def sample_ratios(
    requests: list[Request], batch: int, shape: tuple[int, int, int]
) -> dict[str, float]:
    """Static's positions, FLOPs and decode steps over continuous's for the full batches of
    these requests that static batching runs saturated (all but the last batch, FIFO), the
    same arithmetic as `positions_bound`, `flops_ratio` and `steps_ratio` on their draws."""
    n_layer, d, vocab = shape
    full = (len(requests) - 1) // batch * batch
    p = np.array([len(r[1]) for r in requests[:full]])
    o = np.array([r[2] for r in requests[:full]])
    if not full:
        return {}
    longest = np.array([o[i : i + batch].max() for i in range(0, full, batch)])
    layer, head = 24 * d * d * n_layer, 2 * d * vocab
    static_pos = int(p.sum()) + int((batch * (longest - 1)).sum())
    cont_pos = int((p + o - 1).sum())
    return {
        "positions": static_pos / cont_pos,
        "flops": (static_pos * layer + int(o.sum()) * head)
        / (cont_pos * layer + int(o.sum()) * head),
        "steps": float(longest.sum() / (o.sum() / batch)),
        "requests": full,
    }


def equal_itl(modes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Among the continuous configurations whose median saturated p99 ITL is at most static's,
    the one with the most saturated tokens/s, and its ratio to static's (medians)."""

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    static_itl = med(modes["static"], "saturated_itl_p99_ms")
    static_tps = med(modes["static"], "saturated_tokens_per_s")
    rows = {
        m: (med(runs, "saturated_itl_p99_ms"), med(runs, "saturated_tokens_per_s"))
        for m, runs in modes.items()
        if m != "static"
    }
    ok = {m: v for m, v in rows.items() if v[0] <= static_itl}
    best = max(ok, key=lambda m: ok[m][1], default=None)
    return {
        "static_p99_itl_ms": static_itl,
        "best": best,
        "ratio": ok[best][1] / static_tps if best else None,
        "p99_itl_over_static": {m: v[0] / static_itl for m, v in rows.items()},
        "tokens_per_s_over_static": {m: v[1] / static_tps for m, v in rows.items()},
    }
