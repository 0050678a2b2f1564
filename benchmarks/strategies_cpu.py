"""What does each parallel strategy cost and save? gpt-tiny on byte tokens of the Python
standard library, 2 CPU processes (gloo), every strategy side by side in one invocation:
throughput (tokens/s, median step time) and per-rank model-state bytes (parameters +
gradients + optimizer state, summed over local shards), as ratios against ddp. Pipeline rows
(`parallel.pp=2`, untied embeddings; pp x ddp on 4 processes) add the measured bubble (the
ranks' mean idle share of the schedule's wall time) and the replayed one (the busiest rank's,
from the measured order and CPU costs: see benchmarks/pipeline_bubble_cpu.py for the gap
between them) beside the planner's (p - 1) / (m + p - 1).

Variants run round-robin (`--repeats` rounds) so that load from other jobs on a shared
machine spreads over all of them; each variant's figure is the median over rounds of the
engine's median step time. On 2 CPU cores communication is cheap and compute is scarce, so
the throughput ratios say what the extra collectives of sharding cost in compute-bound
conditions, not what they cost across a network.

    python benchmarks/strategies_cpu.py [--steps 40] [--repeats 2] [--batch 16] [--seq-len 64]
        [--model gpt-tiny] [--only ddp,zero3]

Writes benchmarks/results/strategies_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))

# Pipeline stages cannot share the embedding with the output head: untied (16k more
# parameters for gpt-tiny than the tied rows above them).
PP = ["parallel.pp=2", "model.args.tie_embeddings=false"]
# name -> (processes, overrides, data-parallel replicas: the global batch is split over them)
VARIANTS: dict[str, tuple[int, list[str], int]] = {
    "1 process": (1, [], 1),
    "ddp": (2, ["parallel.strategy=ddp"], 2),
    "zero1": (2, ["parallel.strategy=zero1"], 2),
    "zero2": (2, ["parallel.strategy=zero2"], 2),
    "zero3": (2, ["parallel.strategy=zero3"], 2),
    "zero3 + full AC": (
        2,
        ["parallel.strategy=zero3", "train.activation_checkpointing=full"],
        2,
    ),
    "tp=2": (2, ["parallel.tp=2"], 1),
    "tp=2 + SP": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], 1),
    "pp=2 gpipe m=4": (2, [*PP, "parallel.pp_schedule=gpipe", "parallel.microbatches=4"], 1),
    "pp=2 1f1b m=4": (2, [*PP, "parallel.pp_schedule=1f1b", "parallel.microbatches=4"], 1),
    "pp=2 1f1b m=8": (2, [*PP, "parallel.pp_schedule=1f1b", "parallel.microbatches=8"], 1),
    "pp=2 x ddp=2": (4, [*PP, "parallel.microbatches=4"], 2),
}

CONFIG = """
model: {{name: {model}}}
data: {{source: tokens, path: {corpus}, seq_len: {seq_len}, batch_size: 1, eval_windows: 8}}
optim: {{name: adamw, lr: 0.003, warmup_steps: 5, grad_clip: 1.0}}
train: {{max_steps: {steps}, eval_every: 0, log_every: 10, seed: 0}}
precision: fp32
"""


def run_variant(config: Path, workdir: Path, name: str, batch: int) -> dict[str, Any]:
    nproc, overrides, replicas = VARIANTS[name]
    per_proc = batch // replicas
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [sys.executable, *(launch if nproc > 1 else []), "-m", "hpcml", "train", str(config)]
    cmd += [*overrides, f"data.batch_size={per_proc}", "--run-dir", str(run_dir), "--quiet"]
    cmd += ["--overwrite"]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
    }
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    per_rank = summary["memory"]["per_rank"]
    return {
        "command": " ".join(cmd[1:]),
        "wall_s": wall,
        "step_time_s": summary["throughput"]["step_time_s"],
        "tokens_per_s": summary["throughput"]["tokens_per_s"],
        "final_train_loss": summary["final"]["train_loss"],
        "model_states_bytes_per_rank": max(r["model_states_bytes"] for r in per_rank),
        "params_bytes_per_rank": max(r["params_bytes"] for r in per_rank),
        "grads_bytes_per_rank": max(r["grads_bytes"] for r in per_rank),
        "optimizer_bytes_per_rank": max(r["optimizer_bytes"] for r in per_rank),
        "peak_rss_bytes_per_rank": max(r["peak_rss_bytes"] for r in per_rank),
        # parallel.pp: each rank's idle share of the schedule, beside the planner's
        "bubble": summary.get("pipeline"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="global batch (windows per step)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--out", type=Path, default=RESULTS / "strategies_cpu.json")
    args = ap.parse_args()

    from hpcml.data.sources.tokens import prepare_pystdlib

    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="hpcml-strategies-"))
    corpus = workdir / "pystdlib"
    prepare_pystdlib(corpus, val_fraction=0.05, max_bytes=4_000_000)
    config = workdir / "bench.yaml"
    config.write_text(
        CONFIG.format(model=args.model, corpus=corpus, seq_len=args.seq_len, steps=args.steps)
    )
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            res = run_variant(config, workdir, name, args.batch)
            samples[name].append(res)
            print(
                f"round {r + 1}/{args.repeats} {name:>16}: {res['tokens_per_s']:>9,.0f} tokens/s  "
                f"{res['model_states_bytes_per_rank']:>10,} B/rank",
                file=sys.stderr,
            )
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = samples[name]
        step = statistics.median(x["step_time_s"] for x in runs)
        rows[name] = {
            **{k: v for k, v in runs[0].items() if k.endswith("_bytes_per_rank")},
            "processes": VARIANTS[name][0],
            "step_time_s": step,
            "tokens_per_s": args.batch * args.seq_len / step,
            "final_train_loss": runs[0]["final_train_loss"],
            "runs": runs,
        }
        if runs[0]["bubble"] is not None:
            rows[name]["predicted_bubble"] = runs[0]["bubble"]["predicted_bubble"]
            for kind in ("measured_bubble", "replayed_bubble"):
                rows[name][kind] = statistics.median(x["bubble"][kind] for x in runs)
    base = rows.get("ddp") or next(iter(rows.values()))
    for row in rows.values():
        row["throughput_vs_ddp"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["model_states_vs_ddp"] = (
            row["model_states_bytes_per_rank"] / base["model_states_bytes_per_rank"]
        )
    report(rows, args)
    import torch

    result = {
        "benchmark": "strategies_cpu",
        "question": "throughput and per-rank model-state memory of each parallel strategy",
        "model": args.model,
        "global_batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "repeats": args.repeats,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "hostname": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "baseline": "ddp",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"), args)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.model}, global batch {args.batch} x {args.seq_len} tokens, fp32, CPU gloo"
    )
    for col in (
        "strategy",
        "procs",
        "tokens/s",
        "vs ddp",
        "step ms",
        "params B/rank",
        "grads B/rank",
        "optim B/rank",
        "states vs ddp",
        "loss@end",
        "bubble meas/repl/pred",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name, r in rows.items():
        table.add_row(
            name,
            str(r["processes"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['throughput_vs_ddp']:.2f}x",
            f"{r['step_time_s'] * 1000:.1f}",
            f"{r['params_bytes_per_rank']:,}",
            f"{r['grads_bytes_per_rank']:,}",
            f"{r['optimizer_bytes_per_rank']:,}",
            f"{r['model_states_vs_ddp']:.2f}x",
            f"{r['final_train_loss']:.4f}",
            f"{r['measured_bubble']:.2f} / {r['replayed_bubble']:.2f} / {r['predicted_bubble']:.2f}"
            if "measured_bubble" in r
            else "",
        )
    Console(width=160).print(table)


def plot(rows: dict[str, dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.barh(names, [rows[n]["tokens_per_s"] for n in names], color="tab:blue")
    a.set_xlabel("tokens/s (all processes)")
    a.invert_yaxis()
    parts = ("params_bytes_per_rank", "grads_bytes_per_rank", "optimizer_bytes_per_rank")
    left = [0.0] * len(names)
    for part, color in zip(parts, ("tab:green", "tab:orange", "tab:red"), strict=True):
        vals = [rows[n][part] / 1e6 for n in names]
        b.barh(names, vals, left=left, color=color, label=part.split("_")[0])
        left = [x + v for x, v in zip(left, vals, strict=True)]
    b.set_xlabel("model-state MB per rank")
    b.invert_yaxis()
    b.legend(loc="lower right")
    fig.suptitle(f"{args.model} on 2 CPU processes: throughput and per-rank memory by strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
