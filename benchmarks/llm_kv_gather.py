"""Decode step time with the KV cache attended in place against gathered into padded copies.

The engine attends a sequence whose blocks form one contiguous run over a view of the cache
(`kv_cache.IN_PLACE_MIN_BYTES`); before, every context was gathered, on every layer at every
step, into a padded `(sequences, heads, context, head_dim)` copy (main's path, kept for split
tables and small contexts). Both run here on one engine, its sequences prefilled once, then
decode steps in rounds that alternate the order of the two paths (gather first in even rounds,
in place first in odd ones), so load on the shared machine hits both alike and both see the
same contexts within a round. Sequences get max_tokens beyond the run, so none ends.

Contexts are seeded and long-tailed: lognormal lengths (median `--median` tokens, sigma
`--sigma`, clipped to 16..`--max-context`; the defaults, median 96 and sigma 0.8, were chosen
near the serving benchmarks' ShareGPT-like workload, prompts of median 32 plus some of outputs
of median 48, not measured from it). Reported: per round, the median step of each path; the
paired ratio (gather / in place) per round; medians and [min .. max] over rounds; the 1-minute
load average before each round; the share of sequences whose table is one run (attended in
place when large enough). And one layer's attention alone, both paths, at each context length
from 16 to 512: where in place starts to pay (`IN_PLACE_MIN_BYTES`). Random weights; the
model's vocabulary is GPT-2's.

    python benchmarks/llm_kv_gather.py   # 4x256 fp32, 12x768 bf16: results/llm_kv_gather.*
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
VOCAB = 50257
BLOCK = 16
MODES = ("gather", "in place")


def contexts(n: int, median: int, sigma: float, longest: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [
        min(longest, max(16, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)
    ]


def engine_for(model: GPT, ctx: list[int], headroom: int, slack: float) -> Engine:
    """An engine whose sequences have prefilled `ctx` and decode next; its cache holds
    `slack` x the blocks they need for `headroom` more tokens each."""
    need = sum(-(-(c + headroom) // BLOCK) for c in ctx)
    config = EngineConfig(
        kv_cache_blocks=int(need * slack),
        block_size=BLOCK,
        max_num_seqs=len(ctx),
        max_batched_tokens=max(ctx) + 1,
    )
    engine = Engine(model, config)
    rng = random.Random(1)
    for c in ctx:
        engine.submit([rng.randrange(VOCAB) for _ in range(c)], SamplingParams(max_tokens=headroom))
    while any(s.computed < len(s.tokens) - 1 for s in engine.running) or engine.waiting:
        engine.step()
    return engine


def one_run_share(engine: Engine) -> float:
    cache = engine.cache
    ok = [kv_cache.one_run(s.table, cache.blocks_for(s.computed)) for s in engine.running]
    return sum(ok) / len(ok)


def time_steps(engine: Engine, steps: int, mode: str) -> list[float]:
    threshold = kv_cache.IN_PLACE_MIN_BYTES
    kv_cache.IN_PLACE_MIN_BYTES = threshold if mode == "in place" else 2**62
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times
    finally:
        kv_cache.IN_PLACE_MIN_BYTES = threshold


def per_context(heads: int, dtype: torch.dtype, seqs: int, reps: int) -> list[dict[str, Any]]:
    """One layer's attention of `seqs` decoding sequences of one context length, each path
    (StepAttention alone, tables in one run): where in place starts to pay, in bytes of keys
    and values per sequence and layer (what `IN_PLACE_MIN_BYTES` compares)."""
    rows = []
    threshold = kv_cache.IN_PLACE_MIN_BYTES
    for ctx in (16, 32, 64, 128, 256, 512):
        blocks = -(-(ctx + 1) // BLOCK)
        cache = kv_cache.PagedKVCache(1, heads, 64, seqs * blocks, BLOCK, dtype)
        items = [
            kv_cache.StepItem(list(range(i * blocks, (i + 1) * blocks)), ctx, 1)
            for i in range(seqs)
        ]
        q, k, v = (torch.randn(1, heads, seqs, 64).to(dtype) for _ in range(3))
        us: dict[str, list[float]] = {m: [] for m in MODES}
        try:
            for r in range(reps):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    kv_cache.IN_PLACE_MIN_BYTES = 0 if mode == "in place" else 2**62
                    step = kv_cache.StepAttention(cache, items)
                    t0 = time.perf_counter()
                    step.attend(0, q, k, v)
                    us[mode].append((time.perf_counter() - t0) * 1e6)
        finally:
            kv_cache.IN_PLACE_MIN_BYTES = threshold
        med = {m: statistics.median(v[1:]) for m, v in us.items()}
        rows.append(
            {
                "context": ctx,
                "kv_bytes_per_sequence_and_layer": 2 * (ctx + 1) * heads * 64 * q.element_size(),
                "us": {m: round(v, 1) for m, v in med.items()},
                "gather_over_in_place": round(med["gather"] / med["in place"], 3),
            }
        )
    return rows


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def run_size(args: argparse.Namespace, layers: int, width: int, dtype: str) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=VOCAB,
        max_seq_len=args.max_context + 512,
        n_layer=layers,
        n_head=width // 64,
        d_model=width,
    )
    model = GPT(cfg).eval().to(getattr(torch, dtype))
    ctx = contexts(args.seqs, args.median, args.sigma, args.max_context, seed=0)
    headroom = 2 * args.rounds * args.steps + 8
    engine = engine_for(model, ctx, headroom, args.slack)
    time_steps(engine, 2, "gather")  # warm-up: first calls of each path
    time_steps(engine, 2, "in place")
    rounds = []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        order = MODES if r % 2 == 0 else MODES[::-1]
        share = one_run_share(engine)
        step_ms = {m: statistics.median(time_steps(engine, args.steps, m)) * 1e3 for m in order}
        rounds.append(
            {
                "load_1min": round(load, 2),
                "first": order[0],
                "one_run_share": round(share, 3),
                "step_ms": {m: round(v, 2) for m, v in step_ms.items()},
                "gather_over_in_place": round(step_ms["gather"] / step_ms["in place"], 3),
            }
        )
        print(f"{layers}x{width} {dtype} round {r}: {rounds[-1]}", flush=True)
    return {
        "per_context_one_layer": per_context(width // 64, getattr(torch, dtype), args.seqs, 21),
        "model": f"{layers} x {width}",
        "dtype": dtype,
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "sequences": args.seqs,
        "contexts": {"sum": sum(ctx), "median": statistics.median(ctx), "max": max(ctx)},
        "kv_cache_blocks": engine.cache.allocator.num_blocks,
        "step_ms": {m: spread([r["step_ms"][m] for r in rounds]) for m in MODES},
        "gather_over_in_place": spread([r["gather_over_in_place"] for r in rounds]),
        "one_run_share": spread([r["one_run_share"] for r in rounds]),
        "load_1min": spread([r["load_1min"] for r in rounds]),
        "rounds": rounds,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| model | dtype | gather step ms | in place step ms | gather / in place "
        "| tables in one run | load (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]

    def s(d: dict[str, float]) -> str:
        return f"{d['median']:g} [{d['min']:g} .. {d['max']:g}]"

    for r in result["sizes"]:
        rows.append(
            f"| {r['model']} ({r['parameters_m']}M) | {r['dtype']} | {s(r['step_ms']['gather'])} "
            f"| {s(r['step_ms']['in place'])} | {s(r['gather_over_in_place'])} "
            f"| {s(r['one_run_share'])} | {s(r['load_1min'])} |"
        )
    rows += [
        "",
        "One layer's attention alone, tables in one run, each context length (microseconds, "
        "median of 20 alternated calls):",
        "",
        "| model | context | KV bytes per sequence and layer | gather us | in place us "
        "| gather / in place |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["sizes"]:
        for c in r["per_context_one_layer"]:
            rows.append(
                f"| {r['model']} {r['dtype']} | {c['context']} | "
                f"{c['kv_bytes_per_sequence_and_layer']:,} | {c['us']['gather']:g} "
                f"| {c['us']['in place']:g} | {c['gather_over_in_place']:g} |"
            )
    note = (
        f"\n{result['sequences']} decoding sequences, contexts lognormal (median "
        f"{result['median']}, sigma {result['sigma']}, at most {result['max_context']}), "
        f"{result['rounds']} "
        f"rounds of {result['steps']} steps per path, alternating which path goes first; "
        f"medians [min .. max] over rounds of each round's median step. {result['machine']}, "
        f"torch {result['torch']}, {result['threads']} thread(s), {result['date']}.\n\n"
        f"Command: `{result['command']}`\n"
    )
    return "\n".join(rows) + "\n" + note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["4x256:float32", "12x768:bfloat16"],
        help="LAYERSxWIDTH:DTYPE (heads of 64)",
    )
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--median", type=int, default=96)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--slack", type=float, default=1.25, help="cache blocks over those the sequences need"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = []
    for size in args.sizes:
        shape, dtype = size.split(":")
        layers, width = (int(v) for v in shape.split("x"))
        sizes.append(run_size(args, layers, width, dtype))
    result: dict[str, Any] = {
        "question": "How much of a decode step does attending contiguous KV tables in place save "
        "over gathering every context into a padded copy?",
        "command": "python benchmarks/llm_kv_gather.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if v != ""
        ),
        "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": args.threads,
        "sequences": args.seqs,
        "median": args.median,
        "sigma": args.sigma,
        "max_context": args.max_context,
        "steps": args.steps,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sizes": sizes,
    }
    stem = "llm_kv_gather" + (f"_{args.tag}" if args.tag else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
