"""Continuous batching vs static batching vs transformers' `generate`: output tokens/s and
inter-token latency at equal p99 inter-token latency.

One model (a randomly initialised GPT-2 made by `transformers`, bytes, float32, imported into
hpcml's `gpt`: the same weights for all; the weights do not change the work, every request
runs to its max_tokens), one Poisson stream of requests (prompt and output lengths drawn
uniformly), replayed in real time against:

  continuous   hpcml's engine, iteration-level batching: sequences join and leave at every
               step, prefill chunked to 32 new tokens per step beside the decodes (decodes
               first), which bounds how much a step's arrivals lengthen it
  static       hpcml's engine, static batching: a batch starts only when the previous one has
               ended; finished sequences stay in it (padding: one recomputed position per
               step) until its longest ends
  hf-generate  `transformers` `generate` with its KV cache, in static batches: prompts left-
               padded to the batch's longest, every row run until the longest has its tokens

The two engine modes use the same engine, KV cache (sized so that a static batch of the
largest `--max-seqs` fits at its longest: no preemption), kernels and limits, so the difference
between them is the scheduling alone. Every mode runs at every `--max-seqs` (sequences per
step), and the comparison the goal asks for, at equal p99 inter-token latency, takes for each
p99 objective in `--itl-objectives` the best output tokens/s each mode reaches with its median
p99 ITL within the objective. Everything runs in-process (no HTTP). Arrivals are submitted
when their time comes; a request's time to first token is measured from its arrival, its
inter-token latencies between its consecutive tokens; output tokens/s is all output tokens over
the time from the first arrival to the last token. Configurations alternate within a
repetition (order rotated every repetition); the report gives the median and [min .. max] over
`--repeats` repetitions.

    python benchmarks/llm_serving.py                # writes benchmarks/results/llm_serving.*
    python benchmarks/llm_serving.py --quick        # fewer requests, for a smoke run
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from llm_hf_generate import left_pad, make_models  # the same GPT-2 and padding as that peer

from hpcml.models.gpt import GPT
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


def workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """Poisson arrivals; output lengths uniform over --output-len, or (--output-dist lognormal)
    long-tailed as chat traces are: median --output-median, log-space sigma --output-sigma,
    clipped to --output-len."""
    rng = random.Random(args.seed)
    t = 0.0
    out = []
    lo, hi = args.output_len
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(256) for _ in range(rng.randint(*args.prompt_len))]
        if args.output_dist == "lognormal":
            n = round(args.output_median * math.exp(args.output_sigma * rng.gauss(0.0, 1.0)))
            out.append((t, prompt, min(hi, max(lo, n))))
        else:
            out.append((t, prompt, rng.randint(lo, hi)))
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
    return metrics(
        requests,
        arrival,
        stamps,
        steps=steps,
        preemptions=engine.preemptions,
        rows_computed=engine.rows_computed,
    )


def metrics(
    requests: list[tuple[float, list[int], int]],
    arrival: dict[int, float],
    stamps: dict[int, list[float]],
    **extra: int,
) -> dict[str, Any]:
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
        **extra,
        "wall_s": end,
    }


def replay_hf(hf: Any, batch: int, requests: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    """Static batches through transformers' `generate` (its KV cache, left padding): when the
    previous batch has ended, up to `batch` waiting requests start together and run until the
    longest has its tokens. A logits processor stamps the time of every decoding step; a
    request's tokens are the first max_tokens steps of its row."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self, times: list[float]) -> None:
            self.times = times

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter() - start)
            return scores

    queue: list[int] = []
    arrival: dict[int, float] = {}
    stamps: dict[int, list[float]] = {}
    steps = rows = 0
    nxt = 0
    start = time.perf_counter()
    while nxt < len(requests) or queue:
        now = time.perf_counter() - start
        while nxt < len(requests) and requests[nxt][0] <= now:
            arrival[nxt] = requests[nxt][0]
            queue.append(nxt)
            nxt += 1
        if not queue:
            time.sleep(max(0.0, requests[nxt][0] - now))
            continue
        chunk, queue = queue[:batch], queue[batch:]
        ids, mask = left_pad([requests[i][1] for i in chunk])
        ids, mask = ids.to(hf.device), mask.to(hf.device)
        width = ids.shape[1]
        longest = max(requests[i][2] for i in chunk)
        times: list[float] = []
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([Stamp(times)]),
            )
        assert len(times) == longest
        for i in chunk:
            stamps[i] = times[: requests[i][2]]
        steps += longest
        rows += len(chunk) * (width + longest - 1)
    return metrics(requests, arrival, stamps, steps=steps, preemptions=0, rows_computed=rows)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    keys = ("output_tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
    for key in (*keys, "rows_computed"):
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


MODES = ("continuous", "static", "hf-generate")


def equal_itl(
    summaries: dict[str, Any], objectives: list[float], modes: tuple[str, ...] = MODES
) -> list[dict[str, Any]]:
    """For each p99 ITL objective, each scheduler's best configuration whose median p99 ITL
    meets it, and continuous batching's output tokens/s over each other's (ratio of medians)."""
    rows = []
    for objective in objectives:
        row: dict[str, Any] = {"itl_p99_objective_ms": objective}
        for mode in modes:
            ok = [
                (s["output_tokens_per_s"]["median"], name)
                for name, s in summaries.items()
                if name.rsplit("-", 1)[0] == mode and s["itl_p99_ms"]["median"] <= objective
            ]
            best = max(ok, default=None)
            row[mode] = (
                None if best is None else {"config": best[1], "output_tokens_per_s": best[0]}
            )
        c = row["continuous"]
        row["ratio"] = {
            m: c["output_tokens_per_s"] / row[m]["output_tokens_per_s"] if c and row[m] else None
            for m in modes[1:]
        }
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--rate", type=float, default=12.0, help="Poisson arrivals per second")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96))
    ap.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    ap.add_argument("--max-seqs", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument(
        "--itl-objectives", type=float, nargs="+", default=[15.0, 25.0, 50.0], help="p99 ms"
    )
    ap.add_argument("--chunk", type=int, default=32, help="continuous: prefill tokens per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--note", default="", help="Written into the results (e.g. machine state).")
    ap.add_argument("--tag", default="")
    ap.add_argument("--output-dist", choices=("uniform", "lognormal"), default="uniform")
    ap.add_argument("--output-median", type=float, default=48.0, help="lognormal: median")
    ap.add_argument("--output-sigma", type=float, default=1.0, help="lognormal: sigma (log)")
    ap.add_argument("--modes", default=",".join(MODES), help="continuous,static,hf-generate")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (hpcml's engine modes)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats, args.max_seqs = 32, 1, [8, 16]
    schedulers = tuple(m for m in MODES if m in args.modes.split(","))
    if schedulers[:1] != ("continuous",):
        raise SystemExit("--modes must include continuous (the ratios are continuous's).")
    torch.set_num_threads(args.threads)
    positions = args.prompt_len[1] + args.output_len[1]
    with tempfile.TemporaryDirectory() as tmp:
        hf, model, model_args = make_models(
            Path(tmp) / "gpt2", args.n_layer, args.d_model, args.seed, max(256, positions)
        )
    model, hf = model.to(args.device), hf.to(args.device)
    requests = workload(args)
    # Cache for every sequence of the largest static batch at its longest: no preemption.
    longest = args.prompt_len[1] + args.output_len[1]
    blocks = max(args.max_seqs) * -(-longest // 16)
    configs: dict[str, EngineConfig | None] = {}
    for n in args.max_seqs:
        for mode in schedulers:
            configs[f"{mode}-{n}"] = (
                None
                if mode == "hf-generate"
                else EngineConfig(
                    kv_cache_blocks=blocks,
                    block_size=16,
                    max_num_seqs=n,
                    max_batched_tokens=n + args.chunk
                    if mode == "continuous"
                    else n * args.prompt_len[1],
                    static_batching=mode == "static",
                )
            )

    def run(name: str, reqs: list[tuple[float, list[int], int]]) -> dict[str, Any]:
        config = configs[name]
        if config is None:
            return replay_hf(hf, int(name.rsplit("-", 1)[1]), reqs)
        return replay(model, config, reqs)

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in configs}
    load_before = os.getloadavg()
    for name in configs:  # warm-up: allocator, kernels
        run(name, requests[:4])
    for rep in range(args.repeats):
        modes = list(configs)
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotate per repetition
        for mode in order:
            r = run(mode, requests)
            runs[mode].append(r)
            print(
                f"rep {rep} {mode:14s} {r['output_tokens_per_s']:8.1f} tok/s  "
                f"ITL p99 {r['itl_p99_ms']:7.1f} ms  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                f"steps {r['steps']}",
                flush=True,
            )
    summaries = {mode: summary(r) for mode, r in runs.items()}
    result = {
        "benchmark": "llm_serving",
        "model": {
            "args": model_args,
            "init": f"random GPT2LMHeadModel (seed {args.seed}), imported into hpcml's gpt",
            "dtype": "float32",
        },
        "workload": {
            "requests": args.requests,
            "rate_per_s": args.rate,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "output_dist": args.output_dist,
            **(
                {"output_median": args.output_median, "output_sigma": args.output_sigma}
                if args.output_dist == "lognormal"
                else {}
            ),
            "output_tokens_mean": statistics.mean(m for _, _, m in requests),
            "seed": args.seed,
        },
        "modes": list(schedulers),
        "device": str(next(model.parameters()).device),
        "engine": {k: asdict(v) for k, v in configs.items() if v is not None},
        "hf_generate": {
            k: {"max_batch": int(k.rsplit("-", 1)[1])} for k, v in configs.items() if v is None
        },
        "threads": args.threads,
        "repeats": args.repeats,
        "summary": summaries,
        "runs": runs,
        "equal_itl": equal_itl(summaries, args.itl_objectives, schedulers),
        "note": args.note,
        "load_average_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
        },
        "command": shlex.join(["python", "benchmarks/llm_serving.py", *sys.argv[1:]]),
    }
    name = "llm_serving" + (f"_{args.tag}" if args.tag else "") + ("_quick" if args.quick else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


def _cell(s: dict[str, Any], key: str) -> str:
    return f"{s[key]['median']:.1f} [{s[key]['min']:.1f} .. {s[key]['max']:.1f}]"


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    modes = tuple(result.get("modes", MODES))
    shape = (
        f"output lognormal (median {w['output_median']:g}, sigma {w['output_sigma']:g}, "
        f"mean {w['output_tokens_mean']:.0f}) clipped to {w['output_len'][0]}-{w['output_len'][1]}"
        if w.get("output_dist") == "lognormal"
        else f"output {w['output_len'][0]}-{w['output_len'][1]}"
    )
    seqs = sorted({c["max_num_seqs"] for c in result["engine"].values()})
    m = result["model"]["args"]
    lines = [
        f"Continuous batching vs static batching vs transformers' generate, {w['requests']} "
        f"requests, Poisson {w['rate_per_s']:g}/s, prompt {w['prompt_len'][0]}-"
        f"{w['prompt_len'][1]} bytes, {shape} tokens, "
        f"at most {', '.join(map(str, seqs))} sequences per step; one GPT-2 ({m['n_layer']} "
        f"layers, d_model {m['d_model']}, float32, on {result.get('device', 'cpu')}) for all, "
        f"{result['threads']} torch "
        f"thread(s); median [min .. max] of {result['repeats']} repetitions.",
        "",
    ]
    load = result["load_average_1m"]
    note = result["note"] + (" " if result["note"] else "")
    note += f"1-minute load average {load['start']:.1f} at the start, {load['end']:.1f} at the end."
    lines += [f"Note: {note}", ""]
    lines += [
        "| scheduling, sequences per step | output tokens/s | ITL p50 ms | ITL p99 ms "
        "| TTFT p50 ms | TTFT p99 ms | positions computed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("output_tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
    for mode, s in result["summary"].items():
        rows = f"{s['rows_computed']['median']:,.0f}"
        lines.append(f"| {mode} | " + " | ".join(_cell(s, k) for k in keys) + f" | {rows} |")
    lines += [
        "",
        "At equal p99 inter-token latency: each scheduler's best configuration whose median p99 "
        "ITL meets the objective; ratios of continuous batching's output tokens/s to the "
        "others', and of the others' token positions computed to continuous batching's.",
        "",
        "| p99 ITL objective ms | "
        + " | ".join(modes)
        + " | "
        + " | ".join(f"continuous / {m}" for m in modes[1:])
        + " | positions, static / continuous |",
        "|---:|" + "---|" * len(modes) + "---:|" * len(modes),
    ]
    for row in result["equal_itl"]:
        cells = [
            "none meets it"
            if row[mode] is None
            else f"{row[mode]['output_tokens_per_s']:.1f} tok/s ({row[mode]['config']})"
            for mode in modes
        ]
        for other in modes[1:]:
            r = row["ratio"][other]
            cells.append("-" if r is None else f"{r:.2f}x")
        work = "-"
        if row["ratio"].get("static") is not None:
            c, st = (result["summary"][row[mode]["config"]] for mode in ("continuous", "static"))
            work = f"{st['rows_computed']['median'] / c['rows_computed']['median']:.2f}x"
        lines.append(f"| {row['itl_p99_objective_ms']:g} | " + " | ".join(cells) + f" | {work} |")
    lines += [
        "",
        "Positions computed: token positions run through the model (prompts, outputs and, in "
        "static batches, the padding of finished sequences; transformers' generate also pads "
        "prompts to the batch's longest). Where a step's cost grows with its positions (a "
        "CPU), their ratio bounds the throughput ratio scheduling can give.",
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
