"""Continuous batching vs static batching: output tokens/s and inter-token latency.

One model (a randomly initialised `gpt`, bytes, float32: the weights do not change the work,
every request runs to its max_tokens), one Poisson stream of requests (prompt and output
lengths drawn uniformly), replayed in real time against the generation engine of
`hpcml.serve.generate` twice per repetition:

  continuous   iteration-level batching: sequences join and leave at every step
  continuous-chunk32  the same with prefill chunked to 32 new tokens per step (decodes first)
  static       a batch starts only when the previous one has ended; finished sequences stay
               in it (padding: one recomputed position per step) until its longest ends

Both use the same engine, KV cache, kernels and limits (`--max-seqs` sequences per step), so
the difference is the scheduling alone. The engine is driven in-process (no HTTP). Arrivals
are submitted when their time comes; a request's time to first token is measured from its
arrival, its inter-token latencies between its consecutive tokens; output tokens/s is all
output tokens over the time from the first arrival to the last token. Modes alternate within a
repetition (order swapped every repetition); the report gives the median and [min .. max] over
`--repeats` repetitions and the ratio of medians.

    python benchmarks/llm_serving.py                # writes benchmarks/results/llm_serving.*
    python benchmarks/llm_serving.py --quick        # fewer requests, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


def workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    rng = random.Random(args.seed)
    t = 0.0
    out = []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(256) for _ in range(rng.randint(*args.prompt_len))]
        out.append((t, prompt, rng.randint(*args.output_len)))
    return out


def replay(
    model: GPT, config: EngineConfig, requests: list[tuple[float, list[int], int]]
) -> dict[str, Any]:
    engine = Engine(model, config)
    arrival: dict[int, float] = {}
    stamps: dict[int, list[float]] = {}
    pending = list(requests)
    start = time.perf_counter()
    steps = 0
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt, max_tokens = pending.pop(0)
            sid = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            arrival[sid] = at
        if not engine.has_work:
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        events = engine.step()
        steps += 1
        done = time.perf_counter() - start
        for ev in events:
            stamps.setdefault(ev.seq_id, []).append(done)
    tokens = sum(len(s) for s in stamps.values())
    end = max(s[-1] for s in stamps.values())
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    ttft = [stamps[i][0] - arrival[i] for i in stamps]
    assert tokens == sum(m for _, _, m in requests)
    return {
        "output_tokens_per_s": tokens / (end - requests[0][0]),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "steps": steps,
        "preemptions": engine.preemptions,
        "wall_s": end,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in ("output_tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=12.0, help="Poisson arrivals per second")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96))
    ap.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--note", default="", help="Written into the results (e.g. machine state).")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = 24, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_seq_len=256, n_layer=4, n_head=4, d_model=256)
    model = GPT(cfg).eval()
    requests = workload(args)
    # Cache for every sequence of a full batch at its longest: no preemption in either mode.
    longest = args.prompt_len[1] + args.output_len[1]
    blocks = args.max_seqs * -(-longest // 16)
    configs = {
        mode: EngineConfig(
            kv_cache_blocks=blocks,
            block_size=16,
            max_num_seqs=args.max_seqs,
            max_batched_tokens=32
            if mode == "continuous-chunk32"
            else args.max_seqs * args.prompt_len[1],
            static_batching=mode == "static",
        )
        for mode in ("continuous", "continuous-chunk32", "static")
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in configs}
    load_before = os.getloadavg()
    replay(model, configs["continuous"], requests[:4])  # warm-up: allocator, kernels
    for rep in range(args.repeats):
        modes = list(configs)
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotate per repetition
        for mode in order:
            r = replay(model, configs[mode], requests)
            runs[mode].append(r)
            print(
                f"rep {rep} {mode:10s} {r['output_tokens_per_s']:8.1f} tok/s  "
                f"ITL p99 {r['itl_p99_ms']:7.1f} ms  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                f"steps {r['steps']}",
                flush=True,
            )
    result = {
        "benchmark": "llm_serving",
        "model": {"args": asdict(cfg), "init": "random (seed 0)", "dtype": "float32"},
        "workload": {
            "requests": args.requests,
            "rate_per_s": args.rate,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
        },
        "engine": {k: asdict(v) for k, v in configs.items()},
        "threads": args.threads,
        "repeats": args.repeats,
        "summary": {mode: summary(r) for mode, r in runs.items()},
        "runs": runs,
        "ratio_output_tokens_per_s": statistics.median(
            r["output_tokens_per_s"] for r in runs["continuous"]
        )
        / statistics.median(r["output_tokens_per_s"] for r in runs["static"]),
        "note": args.note,
        "load_average_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "command": shlex.join(["python", "benchmarks/llm_serving.py", *sys.argv[1:]]),
    }
    name = "llm_serving" + (f"_{args.tag}" if args.tag else "") + ("_quick" if args.quick else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [
        f"Continuous vs static batching, {w['requests']} requests, Poisson {w['rate_per_s']:g}/s, "
        f"prompt {w['prompt_len'][0]}-{w['prompt_len'][1]} bytes, output "
        f"{w['output_len'][0]}-{w['output_len'][1]} tokens, at most "
        f"{result['engine']['static']['max_num_seqs']} sequences per step; gpt {result['model']['args']['n_layer']} "
        f"layers d_model {result['model']['args']['d_model']}, float32, {result['threads']} torch "
        f"thread(s); median [min .. max] of {result['repeats']} repetitions.",
        "",
    ]
    load = result["load_average_1m"]
    note = result["note"] + (" " if result["note"] else "")
    note += f"1-minute load average {load['start']:.1f} at the start, {load['end']:.1f} at the end."
    lines += [f"Note: {note}", ""]
    lines += [
        "| scheduling | output tokens/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | TTFT p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, s in result["summary"].items():
        cells = [
            f"{s[k]['median']:.1f} [{s[k]['min']:.1f} .. {s[k]['max']:.1f}]"
            for k in (
                "output_tokens_per_s",
                "itl_p50_ms",
                "itl_p99_ms",
                "ttft_p50_ms",
                "ttft_p99_ms",
            )
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"continuous / static output tokens/s: {result['ratio_output_tokens_per_s']:.2f}x "
        "(ratio of medians)",
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
