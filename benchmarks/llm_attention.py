"""Decode step time with one long context among short ones: attention cost follows the contexts.

32 decoding sequences on a 4-layer, 256-wide, 4-head gpt (float32, one thread): all with
48-token contexts, then one of them with a 1500-token context instead. The step is timed as
the engine runs it (sequences attended in place where their blocks form one run, the others
bucketed by context) and with every sequence gathered into one group padded to the longest
context (what the engine did before; forced here by making a group cost more than any padding
and in-place attention never pay), alternating in one run so machine noise hits both alike.
The committed result (2026-11-27) predates in-place attention: its first column is bucketed
gathers.

The goal (issue 32): the mixed step over the short step takes at most 1.5x the ratio of the
attention positions the two steps hold (sum of contexts), i.e. the long context costs its own
positions, not 32 x its length. Positions are counted in whole 16-token blocks, as gathered.

    python benchmarks/llm_attention.py            # writes benchmarks/results/llm_attention.*
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.generate import kv_cache
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
SHORT, LONG, SEQS = 48, 1500, 32
BOUND = 1.5


def engine_at(model: GPT, contexts: list[int]) -> Engine:
    """An engine whose sequences have these contexts prefilled and decode next."""
    need = sum(-(-(c + 200) // BLOCK) for c in contexts)
    config = EngineConfig(
        kv_cache_blocks=need, block_size=BLOCK, max_num_seqs=SEQS, max_batched_tokens=4096
    )
    engine = Engine(model, config)
    rng = random.Random(0)
    for c in contexts:
        engine.submit([rng.randrange(256) for _ in range(c)], SamplingParams(max_tokens=200))
    engine.step()
    assert len(engine.running) == SEQS
    return engine


def time_steps(engine: Engine, steps: int, padded: bool) -> float:
    """Median seconds of `steps` decode steps."""
    cost, in_place = kv_cache.GROUP_COST_POSITIONS, kv_cache.IN_PLACE_MIN_BYTES
    kv_cache.GROUP_COST_POSITIONS = 10**12 if padded else cost
    # Padded: every sequence gathered into the one group (none attended in place).
    kv_cache.IN_PLACE_MIN_BYTES = 2**62 if padded else in_place
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        kv_cache.GROUP_COST_POSITIONS, kv_cache.IN_PLACE_MIN_BYTES = cost, in_place


def positions(contexts: list[int]) -> int:
    return sum(-(-(c + 1) // BLOCK) * BLOCK for c in contexts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_seq_len=2048, n_layer=4, n_head=4, d_model=256)
    model = GPT(cfg).eval()
    short_ctx, mixed_ctx = [SHORT] * SEQS, [LONG] + [SHORT] * (SEQS - 1)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, ctx, padded in (
            ("short", short_ctx, False),
            ("mixed", mixed_ctx, False),
            ("short padded", short_ctx, True),
            ("mixed padded", mixed_ctx, True),
        ):
            t = time_steps(engine_at(model, ctx), args.steps, padded)
            times.setdefault(name, []).append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    pos_ratio = positions(mixed_ctx) / positions(short_ctx)
    result: dict[str, Any] = {
        "question": "Does one long context among 31 short ones slow a decode step only by its own "
        "positions (bucketed attention), not 32 x its length (one padded group)?",
        "command": "python benchmarks/llm_attention.py",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
        "step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "positions_ratio": round(pos_ratio, 3),
        "time_ratio": round(med["mixed"] / med["short"], 3),
        "time_ratio_padded": round(med["mixed padded"] / med["short padded"], 3),
        "bound": round(BOUND * pos_ratio, 3),
        "date": time.strftime("%Y-%m-%d"),
    }
    result["within_bound"] = result["time_ratio"] <= result["bound"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llm_attention.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        "| step | as the engine runs it (ms) | one padded group (ms) |",
        "|---|---|---|",
        f"| 32 x {SHORT} | {result['step_ms']['short']} | {result['step_ms']['short padded']} |",
        f"| 1 x {LONG} + 31 x {SHORT} | {result['step_ms']['mixed']} "
        f"| {result['step_ms']['mixed padded']} |",
        f"| ratio | {result['time_ratio']} | {result['time_ratio_padded']} |",
    ]
    note = (
        f"\nPositions ratio {result['positions_ratio']}; goal: the engine's ratio <= "
        f"{BOUND} x that = {result['bound']} ({'met' if result['within_bound'] else 'missed'}). "
        f"{result['machine']}, torch {result['torch']}, one thread, {result['date']}.\n"
    )
    (RESULTS / "llm_attention.md").write_text("\n".join(rows) + "\n" + note)
    print("\n".join(rows) + note)


if __name__ == "__main__":
    main()
