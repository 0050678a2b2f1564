"""LoRA vs full fine-tuning of the same gpt export, and LoRA on the same base held as int8
(`finetune.base_dtype: int8`, QLoRA-style) vs fp32, side by side in one invocation: model-state
bytes (parameters + gradients + optimizer state), saved activations, peak RSS, median step
time, checkpoint bytes and the validation loss reached at equal steps.

A base is trained first (`--pretrain-steps`, every parameter, byte tokens of the Python
standard library); the three fine-tuning runs start from its export (`model.init_from`) on the same
data for `--steps` steps, one process each, through the real `hpcml train`. LoRA gets a higher
learning rate (`--lora-lr`, as adapters usually do); both use the same schedule and batch.
On a CPU `peak_rss_bytes` is dominated by the interpreter and torch itself; the model-state
and saved-activation bytes are the training memory that scales with the model.

    python benchmarks/finetune.py [--model gpt-tiny] [--args '{"n_layer": 4, "d_model": 256}']
        [--pretrain-steps 150] [--steps 100] [--batch 8] [--seq-len 64] [--r 8]

Writes benchmarks/results/finetune.json and .md.
"""

from __future__ import annotations

import argparse
import json
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
data: {{source: tokens, path: {corpus}, seq_len: {seq_len}, batch_size: {batch}, eval_windows: 64}}
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


def row(s: dict[str, Any], run: Path) -> dict[str, Any]:
    m = s["memory"]
    return {
        "trainable_params": s["finetune"]["trainable_params"],
        "total_params": s["finetune"]["total_params"],
        "param_bytes": s["finetune"]["param_bytes"],
        "model_states_bytes": m["model_states_bytes"],
        "saved_activation_bytes": m["saved_activation_bytes"],
        "peak_rss_bytes": m["peak_rss_bytes"],
        "step_time_s": s["throughput"]["step_time_s"],
        "checkpoint_bytes": checkpoint_bytes(run),
        "val_loss": s["final"]["val_loss"],
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
    ap.add_argument("--full-lr", type=float, default=1e-3)
    ap.add_argument("--lora-lr", type=float, default=3e-3)
    a = ap.parse_args()
    from hpcml.data.sources.tokens import prepare_pystdlib

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_pystdlib(root / "corpus", val_fraction=0.1, max_bytes=2_000_000)
        config = root / "ft.yaml"
        config.write_text(
            CONFIG.format(
                model=a.model, args=a.args, corpus=root / "corpus", seq_len=a.seq_len, batch=a.batch
            )
        )
        base = train(config, root / "base", f"train.max_steps={a.pretrain_steps}")
        common = [
            f"model.init_from={root / 'base/export'}",
            f"train.max_steps={a.steps}",
            f"train.checkpoint_every={a.steps}",
        ]
        rows = {
            "full": row(
                train(config, root / "full", *common, f"optim.lr={a.full_lr}"), root / "full"
            ),
            "lora": row(
                train(
                    config,
                    root / "lora",
                    *common,
                    "finetune.method=lora",
                    f"finetune.r={a.r}",
                    f"finetune.alpha={2 * a.r}",
                    f"optim.lr={a.lora_lr}",
                ),
                root / "lora",
            ),
            "lora_int8": row(
                train(
                    config,
                    root / "lora_int8",
                    *common,
                    "finetune.method=lora",
                    "finetune.base_dtype=int8",
                    f"finetune.r={a.r}",
                    f"finetune.alpha={2 * a.r}",
                    f"optim.lr={a.lora_lr}",
                ),
                root / "lora_int8",
            ),
        }
    full, lora = rows["full"], rows["lora"]
    ratios = {
        k: lora[k] / full[k]
        for k in ("model_states_bytes", "peak_rss_bytes", "step_time_s", "checkpoint_bytes")
    }
    ratios["val_loss"] = lora["val_loss"] / full["val_loss"]
    int8 = rows["lora_int8"]
    int8_ratios = {
        k: int8[k] / lora[k]
        for k in ("param_bytes", "model_states_bytes", "peak_rss_bytes", "step_time_s", "val_loss")
    }
    result = {
        "question": "LoRA vs full fine-tuning of the same export, and LoRA on an int8 vs fp32 base, at equal steps",
        "command": "python benchmarks/finetune.py " + " ".join(sys.argv[1:]),
        "settings": vars(a),
        "base_val_loss": base["final"]["val_loss"],
        "runs": rows,
        "lora_over_full": ratios,
        "lora_int8_over_lora": int8_ratios,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "finetune.json").write_text(json.dumps(result, indent=2) + "\n")
    keys = list(full)
    lines = [
        "# LoRA vs full fine-tuning (benchmarks/finetune.py)",
        "",
        f"`{result['command']}`; base val_loss {result['base_val_loss']:.4f}.",
        "",
        "| | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |")
    lines += ["", "lora / full: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), ""]
    lines += ["lora_int8 / lora: " + ", ".join(f"{k} {v:.3f}" for k, v in int8_ratios.items()), ""]
    (RESULTS / "finetune.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
