"""What limits continuous batching on the long-tailed workload: every engine step recorded.

One Poisson stream of the long-tailed (ShareGPT-like) workload of `llm_serving_http.py`
(prompts lognormal median 32, sigma 0.8, max 512; outputs lognormal median 48, sigma 1.0, max
384; token ids of GPT-2's 50,257-token vocabulary) is replayed in real time, in-process, against
hpcml's engine with static batching and with continuous batching at each prompt-token budget of
`--prefill` (`generation.max_prefill_tokens`: prompt tokens in a step that also decodes;
`none`: only `max_batched_tokens` 256 bounds them), in rotating order for `--repeats`
repetitions. `--rate inf` submits every request at once, so both modes run saturated: the
question of the issue (what a server serves at its capacity, at equal p99 inter-token latency)
is answered over the **saturated steps**, those after which requests still waited (static: all
batches but the last; continuous: until the last request is admitted), not over the drain of
the long tail at a falling batch size, which neither mode controls. Every step's decodes, prompt
tokens, padding rows (static batching's finished sequences) and seconds are recorded
(`Engine.last_step`), and for each configuration:

- output tokens/s over the run, over the arrival window, and over the saturated steps;
- p50/p99 inter-token latency (over the run and over the saturated steps), p50 time to first
  token;
- decodes per step, the share of positions that are prompt tokens, the share of steps that
  carry prompt tokens;
- a least-squares fit of step seconds = fixed + per decode x decodes + per prompt token x
  prompt tokens + per padding row x padding rows (what each kind of row costs here);
- `--breakdown K`: where K saturated steps' seconds go, by part of the engine (scheduling,
  the attention's step set-up, the model's forward by kind of op: the layers' matmuls, the LM
  head, the KV cache's writes and gathers, attention, the rest; sampling and bookkeeping),
  from torch's profiler on top of plain timers;

and the ratios of static's work over continuous's for the workload, in saturated batches:
positions (every position costs the same: the positions bound of `llm_serving_http.py`), FLOPs
(a position costs 24 d^2 per layer, and a row whose logits are read another 2 d V: static
batching's padding rows read none, so with a large vocabulary on a small model they cost
little), decode steps (static's steps over continuous's when a step costs the same whatever its
rows: the ceiling where the weights' memory traffic, not arithmetic, sets a step's cost) and
fitted (the fit's costs per row and per step, each mode's steps at saturation).

    python benchmarks/llm_step_profile.py                 # results/llm_step_profile.{json,md}
    python benchmarks/llm_step_profile.py --n-layer 12 --d-model 768 --dtype bf16 --rate inf \
        --requests 49 --prefill none 32 16 --repeats 3 --breakdown 6 --threads 2 --tag gpt2_small
"""

from __future__ import annotations

import argparse
import json
import math
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
from llm_step_breakdown import breakdown
from llm_work_ratios import equal_itl, fitted_ratio, sample_ratios, steps_ratio

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"
Request = tuple[float, list[int], int]
Step = tuple[int, int, int, float, bool]
"""decodes, prompt tokens, padding rows, seconds, saturated (requests still waited after it)."""


def stream(n: int, rate: float, vocab: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompt, output = WORKLOADS["long-tailed"]
    gaps = rng.exponential(1.0 / rate, size=n) if math.isfinite(rate) else np.zeros(n)
    p, o = prompt.draw(n, rng), output.draw(n, rng)
    return [
        (float(t), [int(x) for x in rng.integers(0, vocab, size=k)], m)
        for t, k, m in zip(np.cumsum(gaps), p, o, strict=True)
    ]


def replay(
    model: GPT, config: EngineConfig, requests: list[Request], saturated_only: bool = False
) -> dict[str, Any]:
    """Every request submitted at its time, the engine stepped until all are done (or, with
    `saturated_only`, until none waits any more: the drain is not measured)."""
    engine = Engine(model, config)
    arrival: dict[int, float] = {}
    stamps: dict[int, list[tuple[float, int]]] = {}  # (seconds, step index)
    steps: list[Step] = []
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
        if saturated_only and steps and not steps[-1][4] and not pending:
            break
        t0 = time.perf_counter()
        events = engine.step()
        t1 = time.perf_counter()
        s = engine.last_step
        steps.append((s.decodes, s.prefill_tokens, s.padding, t1 - t0, bool(engine.waiting)))
        for ev in events:
            stamps.setdefault(ev.seq_id, []).append((t1 - start, len(steps) - 1))
    return summarise(requests, arrival, stamps, steps)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarise(
    requests: list[Request],
    arrival: dict[int, float],
    stamps: dict[int, list[tuple[float, int]]],
    steps: list[Step],
) -> dict[str, Any]:
    first, last = requests[0][0], requests[-1][0]
    every = [t for s in stamps.values() for t, _ in s]
    gaps = [b - a for s in stamps.values() for (a, _), (b, _) in zip(s, s[1:], strict=False)]
    # Saturated: gaps that end in a step after which requests still waited.
    sat_gaps = [
        b - a
        for s in stamps.values()
        for (a, _), (b, i) in zip(s, s[1:], strict=False)
        if steps[i][4]
    ]
    sat_tokens = sum(1 for s in stamps.values() for _, i in s if steps[i][4])
    sat_seconds = sum(st[3] for st in steps if st[4])
    ttft = [stamps[i][0][0] - arrival[i] for i in stamps]
    a = np.array([st[:4] for st in steps], dtype=float)
    x = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1], a[:, 2]])
    fit = np.linalg.lstsq(x, a[:, 3], rcond=None)[0]
    rows = a[:, 0] + a[:, 1] + a[:, 2]
    window = sum(first <= t <= last for t in every) / (last - first) if last > first else None
    return {
        "output_tokens_per_s": len(every) / (max(every) - first),
        "window_tokens_per_s": window,
        "saturated_tokens_per_s": sat_tokens / sat_seconds if sat_seconds else None,
        "saturated_steps": sum(1 for st in steps if st[4]),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "saturated_itl_p50_ms": 1e3 * pct(sat_gaps, 50),
        "saturated_itl_p99_ms": 1e3 * pct(sat_gaps, 99),
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "steps": len(steps),
        "decodes_per_step": float(a[:, 0].mean()),
        "prefill_share_of_positions": float(a[:, 1].sum() / rows.sum()),
        "steps_with_prefill": float((a[:, 1] > 0).mean()),
        "fit_ms": dict(zip(("fixed", "decode", "prompt_token", "padding"), 1e3 * fit, strict=True)),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        result["title"],
        "",
        f"Note: {result['note']}",
        "",
        "| mode | output tok/s | "
        "saturated tok/s | p99 ITL ms | saturated p50 / p99 ITL ms | p50 TTFT ms | decodes "
        "/ step | prompt share of positions | steps with prompt tokens | fit ms: fixed, per "
        "decode, per prompt token, per padding row |",
        "|---|---|---|---|---|---|---:|---:|---:|---|",
    ]

    def cell(runs: list[dict[str, Any]], key: str) -> str:
        v = [r[key] for r in runs if r.get(key) is not None]
        if not v:
            return "-"
        return f"{statistics.median(v):,.1f} [{min(v):,.1f} .. {max(v):,.1f}]"

    for mode, runs in result["modes"].items():
        fit = result["fits_ms"][mode]
        sat = (
            f"{statistics.median(r['saturated_itl_p50_ms'] for r in runs):,.0f} / "
            f"{cell(runs, 'saturated_itl_p99_ms')}"
        )
        lines.append(
            f"| {mode} | {cell(runs, 'output_tokens_per_s')} | "
            f"{cell(runs, 'saturated_tokens_per_s')} | {cell(runs, 'itl_p99_ms')} | {sat} | "
            f"{cell(runs, 'ttft_p50_ms')} | "
            f"{statistics.median(r['decodes_per_step'] for r in runs):.1f} | "
            f"{statistics.median(r['prefill_share_of_positions'] for r in runs):.2f} | "
            f"{statistics.median(r['steps_with_prefill'] for r in runs):.2f} | "
            + ", ".join(f"{fit[k]:.2f}" for k in ("fixed", "decode", "prompt_token", "padding"))
            + " |"
        )
    b = result["work_ratios"]
    lines += [
        "",
        f"Static's work over continuous's for this workload at "
        f"{result['max_seqs']} sequences: positions {b['positions']:.2f}x, FLOPs "
        f"{b['flops']:.2f}x, decode steps {b['steps']:.2f}x, fitted step cost "
        f"{b['fitted']:.2f}x.",
    ]
    if result.get("sample_ratios"):
        c = result["sample_ratios"]
        lines += [
            "",
            f"The same ratios for the {c['requests']} requests of static's saturated "
            f"batches in this run: positions {c['positions']:.2f}x, FLOPs {c['flops']:.2f}x, "
            f"decode steps {c['steps']:.2f}x.",
        ]
    lines += [
        "",
        "Continuous / static, per repetition (output tok/s over the run; over the saturated "
        "steps):",
        "",
    ]
    for mode, ratios in result["ratios"].items():
        lines.append(
            f"- {mode}: "
            + ", ".join(f"{r:.2f}x / " + ("-" if s is None else f"{s:.2f}x") for r, s in ratios)
        )
    if result.get("equal_itl"):
        e = result["equal_itl"]
        lines += [
            "",
            "Saturated, medians, over static's (p99 ITL; tokens/s): "
            + "; ".join(
                f"{m} {e['p99_itl_over_static'][m]:.2f}x; {e['tokens_per_s_over_static'][m]:.2f}x"
                for m in e["p99_itl_over_static"]
            )
            + ". "
            + (
                f"At a p99 ITL no worse than static's ({e['static_p99_itl_ms']:,.0f} ms): "
                f"{e['best']}, {e['ratio']:.2f}x static's tokens/s."
                if e["best"]
                else f"No continuous configuration's p99 ITL is within static's "
                f"({e['static_p99_itl_ms']:,.0f} ms)."
            ),
        ]
    if result.get("breakdown"):
        lines += [
            "",
            "Where a saturated step's time goes (ms per step, median of the profiled "
            "steps; the forward's parts from torch's profiler, which slows each op a little):",
            "",
            "| part | " + " | ".join(result["breakdown"]) + " |",
            "|---|" + "---:|" * len(result["breakdown"]),
        ]
        parts = list(next(iter(result["breakdown"].values())))
        for part in parts:
            lines.append(
                f"| {part} | "
                + " | ".join(f"{b[part]:.1f}" for b in result["breakdown"].values())
                + " |"
            )
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dtype", choices=("float32", "bf16"), default="float32")
    ap.add_argument(
        "--rate", type=float, default=4.0, help="arrivals per second (inf: all at once)"
    )
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument(
        "--prefill",
        nargs="+",
        default=["none", "64", "32", "8"],
        help="continuous: max_prefill_tokens values (none: unbounded)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--breakdown",
        type=int,
        default=0,
        help="profile this many saturated steps of each mode (0: none)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    return ap.parse_args()


def configs(a: argparse.Namespace) -> dict[str, EngineConfig]:
    blocks = a.max_seqs * 64  # a whole static batch at the longest fits: no preemption
    out = {
        "static": EngineConfig(
            kv_cache_blocks=blocks,
            max_num_seqs=a.max_seqs,
            max_batched_tokens=a.max_seqs * 512,
            prefix_sharing=False,
            static_batching=True,
        )
    }
    for p in a.prefill:
        out[f"continuous, prefill {p}"] = EngineConfig(
            kv_cache_blocks=blocks,
            max_num_seqs=a.max_seqs,
            prefix_sharing=False,
            max_prefill_tokens=None if p == "none" else int(p),
        )
    return out


def run_modes(
    model: GPT,
    cfgs: dict[str, EngineConfig],
    requests: list[Request],
    repeats: int,
    load: list[float],
    saturated_only: bool,
) -> dict[str, list[dict[str, Any]]]:
    modes: dict[str, list[dict[str, Any]]] = {m: [] for m in cfgs}
    names = list(cfgs)
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            r = replay(model, cfgs[name], requests, saturated_only)
            r["load_average"] = os.getloadavg()[0]
            load.append(r["load_average"])
            modes[name].append(r)
            sat = r["saturated_tokens_per_s"]
            print(
                f"rep {rep} {name:24s} {r['output_tokens_per_s']:8.1f} tok/s  saturated "
                f"{sat or float('nan'):8.1f}  ITL p99 {r['itl_p99_ms']:7.1f} ms (saturated "
                f"{r['saturated_itl_p99_ms']:7.1f})  load {r['load_average']:.1f}",
                flush=True,
            )
    return modes


def main() -> None:
    a = arguments()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = GPTConfig(
        vocab_size=a.vocab,
        max_seq_len=1024,
        n_layer=a.n_layer,
        n_head=max(1, a.d_model // 64),
        d_model=a.d_model,
    )
    model = GPT(cfg).eval()
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    requests = stream(a.requests, a.rate, a.vocab, a.seed)
    cfgs = configs(a)
    load = [os.getloadavg()[0]]
    # All at once: stop when no request waits (the long tail's drain is no one's capacity).
    modes = run_modes(model, cfgs, requests, a.repeats, load, not math.isfinite(a.rate))
    parts = (
        {
            m: breakdown(model, c, [(p, o) for _, p, o in requests], a.breakdown)
            for m, c in cfgs.items()
        }
        if a.breakdown
        else {}
    )
    fits = {
        m: {k: statistics.median(r["fit_ms"][k] for r in runs) for k in runs[0]["fit_ms"]}
        for m, runs in modes.items()
    }
    pooled = {k: statistics.median(f[k] for f in fits.values()) for k in fits["static"]}
    prompt, output = WORKLOADS["long-tailed"]
    ratios = {
        m: [
            (
                r["output_tokens_per_s"] / s["output_tokens_per_s"],
                r["saturated_tokens_per_s"] / s["saturated_tokens_per_s"]
                if r["saturated_tokens_per_s"] and s["saturated_tokens_per_s"]
                else None,
            )
            for r, s in zip(runs, modes["static"], strict=True)
        ]
        for m, runs in modes.items()
        if m != "static"
    }
    params = sum(p.numel() for p in model.parameters())
    rate = "all at once" if not math.isfinite(a.rate) else f"Poisson arrivals at {a.rate:g}/s"
    result = {
        "benchmark": "llm_step_profile",
        "title": (
            f"Engine steps on the long-tailed workload, in-process: gpt {a.n_layer} x "
            f"{a.d_model}, vocabulary {a.vocab} ({params / 1e6:.0f}M parameters, random "
            f"weights, {a.dtype}), {a.requests} requests, {rate}, at most "
            f"{a.max_seqs} sequences per step, {a.threads} torch thread(s), {a.repeats} "
            f"repetitions (median [min .. max]); {platform.processor() or platform.machine()}"
            f", {time.strftime('%Y-%m-%d')}"
        ),
        "note": (a.note + " " if a.note else "") + f"1-minute load average {min(load):.1f} to "
        f"{max(load):.1f} during the run.",
        "max_seqs": a.max_seqs,
        "modes": modes,
        "fits_ms": fits,
        "ratios": ratios,
        "breakdown": parts,
        "equal_itl": equal_itl(modes) if not math.isfinite(a.rate) else None,
        "sample_ratios": sample_ratios(requests, a.max_seqs, (a.n_layer, a.d_model, a.vocab))
        if not math.isfinite(a.rate)
        else {},
        "work_ratios": {
            "positions": positions_bound(prompt, output, a.max_seqs, a.seed),
            "flops": flops_ratio(
                prompt, output, a.max_seqs, a.seed, (a.n_layer, a.d_model, a.vocab)
            ),
            "steps": steps_ratio(a.max_seqs, a.seed),
            "fitted": fitted_ratio(pooled, a.max_seqs, a.seed),
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "command": shlex.join(["python", "benchmarks/llm_step_profile.py", *sys.argv[1:]]),
    }
    name = "llm_step_profile" + (f"_{a.tag}" if a.tag else "")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out_dir / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
