"""LoRA vs full fine-tuning of the same gpt export, and LoRA on the same base held as int8 or
nf4 (`finetune.base_dtype`, QLoRA-style) vs fp32, side by side in one invocation: model-state
bytes (parameters + gradients + optimizer state), saved activations, peak RSS and the RSS the
run added once its libraries were imported (peak RSS minus `rss_before_model_bytes`), median
step time, checkpoint bytes and the validation loss reached at equal steps; the load average
beside each run. The issue's goals are checked and printed as met or not.

A base is trained first (`--pretrain-steps`, every parameter, byte tokens of the Python standard
library); the fine-tuning runs start from its export (`model.init_from`) on the same data for
`--steps` steps, one process each, through the real `hpcml train`. LoRA gets a higher learning
rate (`--lora-lr`, as adapters usually do); both use the same schedule and batch. On a CPU the
peak RSS of a small model is dominated by the interpreter, torch and (for LoRA) PEFT with
transformers; `rss_growth_bytes` leaves those out, and the model-state bytes are the part that
scales with the model.

    python benchmarks/finetune.py [--model gpt-tiny] [--args '{"n_layer": 4, "d_model": 256}']
        [--pretrain-steps 150] [--steps 100] [--batch 8] [--seq-len 64] [--r 8] [--eval-windows 64]
        [--runs full,lora,lora_int8,lora_nf4] [--out finetune]

Writes benchmarks/results/OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))

CONFIG = """
model: {{name: {model}, args: {args}}}
data: {{source: tokens, path: {corpus}, seq_len: {seq_len}, batch_size: {batch}, eval_windows: {eval_windows}}}
optim: {{name: adamw, lr: 0.003, warmup_steps: 10, grad_clip: 1.0}}
train: {{max_steps: 10, eval_every: 0, log_every: 10, seed: 0}}
precision: fp32
"""


def train(config: Path, run: Path, *overrides: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hpcml", "train", str(config), *overrides]
    cmd += ["--run-dir", str(run), "--quiet", "--overwrite"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads((run / "summary.json").read_text()))


def checkpoint_bytes(run: Path) -> int:
    last = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
    return sum(p.stat().st_size for p in last.rglob("*") if p.is_file())


def row(s: dict[str, Any], run: Path, load: tuple[float, float]) -> dict[str, Any]:
    m = s["memory"]
    return {
        "trainable_params": s["finetune"]["trainable_params"],
        "total_params": s["finetune"]["total_params"],
        "param_bytes": s["finetune"]["param_bytes"],
        "model_states_bytes": m["model_states_bytes"],
        "saved_activation_bytes": m["saved_activation_bytes"],
        "peak_rss_bytes": m["peak_rss_bytes"],
        "rss_before_model_bytes": m["rss_before_model_bytes"],
        "rss_growth_bytes": m["peak_rss_bytes"] - m["rss_before_model_bytes"],
        "step_time_s": s["throughput"]["step_time_s"],
        "checkpoint_bytes": checkpoint_bytes(run),
        "val_loss": s["final"]["val_loss"],
        "load_avg_1m_before_after": list(load),
    }


LORA_RUNS = {"lora": "fp32", "lora_int8": "int8", "lora_nf4": "nf4"}


def fine_tune(a: argparse.Namespace, config: Path, root: Path, name: str) -> dict[str, Any]:
    """One fine-tuning run from the base export: `full`, or LoRA on a `LORA_RUNS` base dtype."""
    common = [
        f"model.init_from={root / 'base/export'}",
        f"train.max_steps={a.steps}",
        f"train.checkpoint_every={a.steps}",
    ]
    if name == "full":
        extra = [f"optim.lr={a.full_lr}"]
    else:
        extra = [
            "finetune.method=lora",
            f"finetune.base_dtype={LORA_RUNS[name]}",
            f"finetune.r={a.r}",
            f"finetune.alpha={2 * a.r}",
            f"optim.lr={a.lora_lr}",
        ]
    before = os.getloadavg()[0]
    s = train(config, root / name, *common, *extra)
    return row(s, root / name, (before, os.getloadavg()[0]))


def goals(full: dict[str, Any], lora: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's three goals, LoRA (fp32 base) over full at equal steps."""
    ratio = {
        "checkpoint_bytes": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
        "peak_rss_bytes": lora["peak_rss_bytes"] / full["peak_rss_bytes"],
        "rss_growth_bytes": lora["rss_growth_bytes"] / full["rss_growth_bytes"],
        "model_states_bytes": lora["model_states_bytes"] / full["model_states_bytes"],
        "val_loss": lora["val_loss"] / full["val_loss"],
    }
    return {
        "checkpoint <= 0.05x full": {
            "ratio": ratio["checkpoint_bytes"],
            "met": ratio["checkpoint_bytes"] <= 0.05,
        },
        "peak RSS <= 0.6x full": {
            "ratio": ratio["peak_rss_bytes"],
            "met": ratio["peak_rss_bytes"] <= 0.6,
        },
        "RSS growth <= 0.6x full": {
            "ratio": ratio["rss_growth_bytes"],
            "met": ratio["rss_growth_bytes"] <= 0.6,
        },
        "model states <= 0.6x full": {
            "ratio": ratio["model_states_bytes"],
            "met": ratio["model_states_bytes"] <= 0.6,
        },
        "val loss within 5% of full": {
            "ratio": ratio["val_loss"],
            "met": abs(ratio["val_loss"] - 1) <= 0.05,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--args", default='{"n_layer": 4, "d_model": 256, "n_head": 4}')
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--full-lr", type=float, default=1e-3)
    ap.add_argument("--lora-lr", type=float, default=3e-3)
    ap.add_argument("--runs", default="full,lora,lora_int8,lora_nf4")
    ap.add_argument("--out", default="finetune", help="results file name (without suffix)")
    a = ap.parse_args()
    from hpcml.data.sources.tokens import prepare_pystdlib

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_pystdlib(root / "corpus", val_fraction=0.1, max_bytes=2_000_000)
        config = root / "ft.yaml"
        config.write_text(
            CONFIG.format(
                model=a.model,
                args=a.args,
                corpus=root / "corpus",
                seq_len=a.seq_len,
                batch=a.batch,
                eval_windows=a.eval_windows,
            )
        )
        load0 = os.getloadavg()[0]
        base = train(config, root / "base", f"train.max_steps={a.pretrain_steps}")
        rows = {name: fine_tune(a, config, root, name) for name in a.runs.split(",")}
    result: dict[str, Any] = {
        "question": "LoRA vs full fine-tuning of the same export, and LoRA on int8 and nf4 bases "
        "vs fp32, at equal steps",
        "command": "python benchmarks/finetune.py " + " ".join(sys.argv[1:]),
        "settings": vars(a),
        "base_val_loss": base["final"]["val_loss"],
        "base_parameters": base["model"]["parameters"],
        "load_avg_1m_at_start": load0,
        "runs": rows,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
    }
    if "full" in rows and "lora" in rows:
        result["goals"] = goals(rows["full"], rows["lora"])
    for name in ("lora_int8", "lora_nf4"):
        if name in rows and "lora" in rows:
            result[f"{name}_over_lora"] = {
                k: rows[name][k] / rows["lora"][k]
                for k in ("param_bytes", "model_states_bytes", "rss_growth_bytes", "val_loss")
            }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    keys = [k for k in next(iter(rows.values())) if k != "load_avg_1m_before_after"]
    lines = [
        "# LoRA vs full fine-tuning (benchmarks/finetune.py)",
        "",
        f"`{result['command']}`; base of {result['base_parameters']:,} parameters, val_loss "
        f"{result['base_val_loss']:.4f}; {os.cpu_count()} CPUs, load average (1 min) "
        f"{load0:.1f} at the start.",
        "",
        "| | " + " | ".join(keys) + " | load before / after |",
        "|---|" + "---|" * (len(keys) + 1),
    ]
    for name, r in rows.items():
        load = " / ".join(f"{x:.1f}" for x in r["load_avg_1m_before_after"])
        lines.append(f"| {name} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + f" | {load} |")
    for goal, g in result.get("goals", {}).items():
        lines.append(f"- {goal}: {g['ratio']:.3f} ({'met' if g['met'] else 'NOT met'})")
    for name in ("lora_int8", "lora_nf4"):
        if f"{name}_over_lora" in result:
            ratios = result[f"{name}_over_lora"].items()
            lines.append(f"- {name} / lora: " + ", ".join(f"{k} {v:.4f}" for k, v in ratios))
    lines.append("")
    (RESULTS / f"{a.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
