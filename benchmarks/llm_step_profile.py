"""What limits continuous batching on the long-tailed workload: every engine step recorded.

One Poisson stream of the long-tailed (ShareGPT-like) workload of `llm_serving_http.py`
(prompts lognormal median 32, sigma 0.8, max 512; outputs lognormal median 48, sigma 1.0, max
384; token ids of GPT-2's 50,257-token vocabulary) is replayed in real time, in-process, against
hpcml's engine with static batching and with continuous batching at each prompt-token budget of
`--prefill` (`generation.max_prefill_tokens`: prompt tokens in a step that also decodes;
`none`: only `max_batched_tokens` 256 bounds them), in rotating order for `--repeats`
repetitions. Every step's decodes, prompt tokens, padding rows (static batching's finished
sequences) and seconds are recorded (`Engine.last_step`), and for each configuration:

- output tokens/s over the run, and over the arrival window (from the first arrival to the last:
  while the queue is fed, before the long tail drains at a falling batch size);
- p50/p99 inter-token latency, p50 time to first token;
- decodes per step, the share of positions that are prompt tokens, the share of steps that
  carry prompt tokens;
- a least-squares fit of step seconds = fixed + per decode x decodes + per prompt token x
  prompt tokens + per padding row x padding rows (what each kind of row costs here);

and three ratios of static's work over continuous's for the workload, in saturated batches:
positions (every position costs the same: the positions bound of `llm_serving_http.py`), FLOPs
(a position costs 24 d^2 per layer, and a row whose logits are read another 2 d V: static
batching's padding rows read none, so with a large vocabulary on a small model they cost
little), and fitted (the fit's costs per row and per step, each mode's steps at saturation).
Where a step has a large fixed cost, the measured ratio moves from the FLOPs ratio toward the
ratio of steps, which is above the positions one.

    python benchmarks/llm_step_profile.py                 # results/llm_step_profile.{json,md}
    python benchmarks/llm_step_profile.py --requests 40 --repeats 1 --prefill 64 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from llm_serving_http import WORKLOADS, flops_ratio, positions_bound

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"
Request = tuple[float, list[int], int]


def stream(n: int, rate: float, vocab: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompt, output = WORKLOADS["long-tailed"]
    gaps = rng.exponential(1.0 / rate, size=n)
    p, o = prompt.draw(n, rng), output.draw(n, rng)
    return [
        (float(t), [int(x) for x in rng.integers(0, vocab, size=k)], m)
        for t, k, m in zip(np.cumsum(gaps), p, o, strict=True)
    ]


def replay(model: GPT, config: EngineConfig, requests: list[Request]) -> dict[str, Any]:
    engine = Engine(model, config)
    arrival: dict[int, float] = {}
    stamps: dict[int, list[float]] = {}
    steps: list[tuple[int, int, int, float]] = []
    pending = list(requests)
    start = time.perf_counter()
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt, max_tokens = pending.pop(0)
            sid = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            arrival[sid] = at
        if not engine.has_work:
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        t0 = time.perf_counter()
        events = engine.step()
        t1 = time.perf_counter()
        s = engine.last_step
        steps.append((s.decodes, s.prefill_tokens, s.padding, t1 - t0))
        for ev in events:
            stamps.setdefault(ev.seq_id, []).append(t1 - start)
    return summarise(requests, arrival, stamps, steps)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarise(
    requests: list[Request],
    arrival: dict[int, float],
    stamps: dict[int, list[float]],
    steps: list[tuple[int, int, int, float]],
) -> dict[str, Any]:
    first, last = requests[0][0], requests[-1][0]
    every = [t for s in stamps.values() for t in s]
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    ttft = [stamps[i][0] - arrival[i] for i in stamps]
    a = np.array(steps, dtype=float)
    x = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1], a[:, 2]])
    fit = np.linalg.lstsq(x, a[:, 3], rcond=None)[0]
    rows = a[:, 0] + a[:, 1] + a[:, 2]
    return {
        "output_tokens_per_s": len(every) / (max(every) - first),
        "window_tokens_per_s": sum(first <= t <= last for t in every) / (last - first),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "steps": len(steps),
        "decodes_per_step": float(a[:, 0].mean()),
        "prefill_share_of_positions": float(a[:, 1].sum() / rows.sum()),
        "steps_with_prefill": float((a[:, 1] > 0).mean()),
        "fit_ms": dict(zip(("fixed", "decode", "prompt_token", "padding"), 1e3 * fit, strict=True)),
    }


def fitted_ratio(fit: dict[str, float], batch: int, seed: int) -> float:
    """Static / continuous seconds at saturation from a fit: static runs each batch for its
    longest output (padding rows for the finished), continuous keeps `batch` decoding."""
    prompt, output = WORKLOADS["long-tailed"]
    rng = np.random.default_rng(seed)
    p, o = np.array(prompt.draw(4096, rng)), np.array(output.draw(4096, rng))
    f, dec, tok, pad = (fit[k] for k in ("fixed", "decode", "prompt_token", "padding"))
    continuous = (o.sum() / batch) * f + (o.sum() - len(o)) * dec + p.sum() * tok
    static = 0.0
    for i in range(0, len(o), batch):
        chunk = o[i : i + batch]
        longest = int(chunk.max())
        static += longest * f + (chunk - 1).sum() * dec + (len(chunk) * (longest - 1) - (chunk - 1).sum()) * pad
    static += p.sum() * tok
    return float(static / continuous)


def markdown(result: dict[str, Any]) -> str:
    lines = [result["title"], "", f"Note: {result['note']}", "", "| mode | output tok/s | in the "
             "arrival window | p50 ITL ms | p99 ITL ms | p50 TTFT ms | decodes / step | prompt "
             "share of positions | steps with prompt tokens | fit ms: fixed, per decode, per "
             "prompt token, per padding row |", "|---|---|---|---|---|---|---:|---:|---:|---|"]

    def cell(runs: list[dict[str, Any]], key: str) -> str:
        v = [r[key] for r in runs]
        return f"{statistics.median(v):,.1f} [{min(v):,.1f} .. {max(v):,.1f}]"

    for mode, runs in result["modes"].items():
        fit = result["fits_ms"][mode]
        lines.append(
            f"| {mode} | " + " | ".join(cell(runs, k) for k in ("output_tokens_per_s",
            "window_tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms"))
            + f" | {statistics.median(r['decodes_per_step'] for r in runs):.1f} | "
            f"{statistics.median(r['prefill_share_of_positions'] for r in runs):.2f} | "
            f"{statistics.median(r['steps_with_prefill'] for r in runs):.2f} | "
            + ", ".join(f"{fit[k]:.2f}" for k in ("fixed", "decode", "prompt_token", "padding"))
            + " |")
    b = result["work_ratios"]
    lines += ["", f"Static's work over continuous's for this workload at "
              f"{result['max_seqs']} sequences: positions {b['positions']:.2f}x, FLOPs "
              f"{b['flops']:.2f}x, fitted step cost {b['fitted']:.2f}x.", "",
              "Continuous / static, per repetition (output tok/s over the run; in the arrival "
              "window):", ""]
    for mode, ratios in result["ratios"].items():
        lines.append(f"- {mode}: " + ", ".join(f"{r:.2f}x / {w:.2f}x" for r, w in ratios))
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dtype", choices=("float32", "bf16"), default="float32")
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--prefill", nargs="+", default=["none", "64", "32", "8"],
                    help="continuous: max_prefill_tokens values (none: unbounded)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    return ap.parse_args()


def main() -> None:
    a = arguments()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = GPTConfig(vocab_size=a.vocab, max_seq_len=1024, n_layer=a.n_layer,
                    n_head=max(1, a.d_model // 64), d_model=a.d_model)
    model = GPT(cfg).eval()
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    requests = stream(a.requests, a.rate, a.vocab, a.seed)
    blocks = a.max_seqs * 64  # a whole static batch at the longest fits: no preemption
    configs = {"static": EngineConfig(kv_cache_blocks=blocks, max_num_seqs=a.max_seqs,
                                      max_batched_tokens=a.max_seqs * 512, prefix_sharing=False,
                                      static_batching=True)}
    for p in a.prefill:
        configs[f"continuous, prefill {p}"] = EngineConfig(
            kv_cache_blocks=blocks, max_num_seqs=a.max_seqs, prefix_sharing=False,
            max_prefill_tokens=None if p == "none" else int(p))
    load = [os.getloadavg()[0]]
    modes: dict[str, list[dict[str, Any]]] = {m: [] for m in configs}
    names = list(configs)
    for rep in range(a.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            r = replay(model, configs[name], requests)
            r["load_average"] = os.getloadavg()[0]
            load.append(r["load_average"])
            modes[name].append(r)
            print(f"rep {rep} {name:24s} {r['output_tokens_per_s']:8.1f} tok/s  window "
                  f"{r['window_tokens_per_s']:8.1f}  ITL p99 {r['itl_p99_ms']:7.1f} ms  "
                  f"load {r['load_average']:.1f}", flush=True)
    fits = {m: {k: statistics.median(r["fit_ms"][k] for r in runs) for k in runs[0]["fit_ms"]}
            for m, runs in modes.items()}
    pooled = {k: statistics.median(f[k] for f in fits.values()) for k in fits["static"]}
    prompt, output = WORKLOADS["long-tailed"]
    ratios = {m: [(r["output_tokens_per_s"] / s["output_tokens_per_s"],
                   r["window_tokens_per_s"] / s["window_tokens_per_s"])
                  for r, s in zip(runs, modes["static"], strict=True)]
              for m, runs in modes.items() if m != "static"}
    params = sum(p.numel() for p in model.parameters())
    result = {
        "benchmark": "llm_step_profile",
        "title": (f"Engine steps on the long-tailed workload, in-process: gpt {a.n_layer} x "
                  f"{a.d_model}, vocabulary {a.vocab} ({params / 1e6:.0f}M parameters, random "
                  f"weights, {a.dtype}), {a.requests} Poisson arrivals at {a.rate:g}/s, at most "
                  f"{a.max_seqs} sequences per step, {a.threads} torch thread(s), {a.repeats} "
                  f"repetitions (median [min .. max]); {platform.processor() or platform.machine()}"
                  f", {time.strftime('%Y-%m-%d')}"),
        "note": (a.note + " " if a.note else "") + f"1-minute load average {min(load):.1f} to "
                f"{max(load):.1f} during the run.",
        "max_seqs": a.max_seqs,
        "modes": modes,
        "fits_ms": fits,
        "ratios": ratios,
        "work_ratios": {
            "positions": positions_bound(prompt, output, a.max_seqs, a.seed),
            "flops": flops_ratio(prompt, output, a.max_seqs, a.seed,
                                 (a.n_layer, a.d_model, a.vocab)),
            "fitted": fitted_ratio(pooled, a.max_seqs, a.seed),
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "command": shlex.join(["python", "benchmarks/llm_step_profile.py", *sys.argv[1:]]),
    }
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "llm_step_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out_dir / "llm_step_profile.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
