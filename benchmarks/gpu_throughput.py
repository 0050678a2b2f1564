"""How fast is one GPU? Three measurements, each against a baseline in the same invocation:

  gpt     gpt2-small (124M) through `hpcml train`: bf16 autocast + torch.compile per block +
          SDPA (FlashAttention on Ampere and newer), seq 1024, on random tokens (vocabulary
          50304): tokens/s and MFU from summary.json, against the same run without compile.
          Goal: >= 50% MFU.
  cnn     simple_cnn on CIFAR-shaped synthetic data held on the GPU (no loader): bf16 +
          channels_last + compile against fp32 eager: samples/s. Goal: >= 100,000 samples/s on
          one H100 (the CIFAR-10 workshop's 8xA100 DDP+AMP figure is ~11,000).
  resnet  ResNet-18 on the same data: bf16 (channels_last) against fp32: speedup. The workshop
          reports ~1.7x; goal >= 2x.

    python benchmarks/gpu_throughput.py [--only gpt,cnn,resnet] [--gpt-steps 60]
        [--gpt-batch 16] [--steps 100]

Needs a CUDA device; without one it says so and writes nothing. Writes
benchmarks/results/gpu_throughput.json (device, versions, commands, results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))

GPT_CONFIG = """
model: {{name: gpt2-small, args: {{vocab_size: 50304}}}}
data: {{source: tokens, path: {data}, seq_len: 1024, batch_size: {batch}, eval_windows: 8,
        num_workers: 2}}
optim: {{name: adamw, lr: 0.0006, betas: [0.9, 0.95], weight_decay: 0.1, warmup_steps: 10,
         grad_clip: 1.0}}
train: {{max_steps: {steps}, eval_every: 0, log_every: 10, compile: {compile}}}
precision: bf16
"""


def random_tokens(folder: Path, vocab: int, n: int) -> None:
    """nanoGPT-format uint16 files of uniform random tokens: the model's speed does not
    depend on what the tokens say."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, size in (("train.bin", n), ("val.bin", n // 20)):
        rng.integers(0, vocab, size, dtype=np.uint16).tofile(folder / name)
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "tokenizer": "random"}))


def gpt_run(workdir: Path, compile_on: bool, steps: int, batch: int) -> dict[str, Any]:
    data = workdir / "tokens"
    if not data.exists():
        random_tokens(data, 50304, 50_000_000)
    config = workdir / f"gpt-compile-{compile_on}.yaml"
    config.write_text(
        GPT_CONFIG.format(data=data, batch=batch, steps=steps, compile=str(compile_on).lower())
    )
    run_dir = workdir / f"run-compile-{compile_on}"
    cmd = [sys.executable, "-m", "hpcml", "train", str(config), "--run-dir", str(run_dir)]
    cmd += ["--quiet", "--overwrite"]
    out = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"gpt run failed:\n{out.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "command": " ".join(cmd[1:]),
        "compile": compile_on,
        "tokens_per_s": s["throughput"]["tokens_per_s"],
        "mfu": s["throughput"]["mfu"],
        "step_time_s": s["throughput"]["step_time_s"],
        "peak_allocated_bytes": s["memory"]["peak_allocated_bytes"],
        "device": s["device"],
    }


def loop_samples_per_s(
    model_name: str, batch: int, steps: int, bf16: bool, channels_last: bool, compile_on: bool
) -> float:
    """A plain training loop on a batch already on the GPU: the model's own speed."""
    import torch
    import torch.nn.functional as F

    from hpcml.models.zoo import build_model

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = build_model(model_name, {}).to(dev)
    x = torch.randn(batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step_model = torch.compile(model) if compile_on else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(step_model(x), y)
        loss.backward()
        opt.step()

    for _ in range(10 if compile_on else 3):  # compile and autotune before timing
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="gpt,cnn,resnet")
    ap.add_argument("--gpt-steps", type=int, default=60)
    ap.add_argument("--gpt-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu_throughput.json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible: nothing measured, nothing written.", file=sys.stderr)
        return
    parts = args.only.split(",")
    results: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="hpcml-gpu-bench-"))
    if "gpt" in parts:
        eager = gpt_run(workdir, False, args.gpt_steps, args.gpt_batch)
        compiled = gpt_run(workdir, True, args.gpt_steps, args.gpt_batch)
        results["gpt2_small_bf16"] = {
            "eager": eager,
            "compiled": compiled,
            "compile_speedup": compiled["tokens_per_s"] / eager["tokens_per_s"],
            "goal": "MFU >= 0.50",
        }
    if "cnn" in parts:
        base = loop_samples_per_s("simple_cnn", 1024, args.steps, False, False, False)
        fast = loop_samples_per_s("simple_cnn", 1024, args.steps, True, True, True)
        results["simple_cnn"] = {
            "fp32_eager_samples_per_s": base,
            "bf16_channels_last_compiled_samples_per_s": fast,
            "speedup": fast / base,
            "goal": "bf16+channels_last+compile >= 100,000 samples/s on one H100",
        }
    if "resnet" in parts:
        fp32 = loop_samples_per_s("resnet18", 256, args.steps, False, True, False)
        bf16 = loop_samples_per_s("resnet18", 256, args.steps, True, True, False)
        results["resnet18"] = {
            "fp32_samples_per_s": fp32,
            "bf16_samples_per_s": bf16,
            "bf16_speedup": bf16 / fp32,
            "goal": "bf16 / fp32 >= 2.0 (workshop: ~1.7)",
        }
    props = torch.cuda.get_device_properties(0)
    out = {
        "benchmark": "gpu_throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": {"name": props.name, "memory_bytes": int(props.total_memory)},
        "environment": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(),
            "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
