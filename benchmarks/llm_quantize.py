"""Float32 vs int8 weights for text generation: perplexity and output tokens/s, side by side.

A gpt (4 x 128, bytes) is trained briefly by `hpcml train` on the Python standard library's
sources (`data prepare pystdlib`, a slice), so perplexity means something; its export is then
loaded twice, once as it is and once with `hpcml.serve.generate.quantize.quantize_int8`
(torchao weight-only int8, what `generation.quantize: int8` serves). For each:

  perplexity   exp(mean next-byte cross-entropy) over --windows evenly spaced windows of the
               validation tokens (files the training never saw), teacher-forced
  tokens/s     hpcml's engine, continuous batching, --requests greedy requests known up front
               (prompts cut from the validation tokens), batch --batch, output tokens over wall
               time; --repeats rotating repetitions, median [min .. max]

    python benchmarks/llm_quantize.py      # writes benchmarks/results/llm_quantize.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def train(tmp: Path, steps: int) -> tuple[Path, Path]:
    from hpcml.config import build_config
    from hpcml.data.sources.tokens import prepare_pystdlib
    from hpcml.train.engine import run

    corpus = tmp / "corpus"
    prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=3_000_000)
    cfg = {
        "model": {"name": "gpt-tiny", "args": {"n_layer": 4, "d_model": 128, "n_head": 4}},
        "data": {
            "source": "tokens",
            "path": str(corpus),
            "seq_len": 128,
            "batch_size": 16,
            "eval_windows": 8,
        },
        "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 20, "decay_steps": steps},
        "train": {
            "max_steps": steps,
            "eval_every": 0,
            "checkpoint_every": 0,
            "log_every": 50,
            "seed": 0,
        },
        "precision": "fp32",
    }
    run(build_config(cfg), run_dir=tmp / "run", quiet=True)
    return tmp / "run" / "export", corpus


def perplexity(model: Any, val: np.ndarray, windows: int, seq: int) -> float:
    starts = np.linspace(0, len(val) - seq - 2, windows).astype(int)
    x = torch.tensor(np.stack([val[s : s + seq] for s in starts]).astype(np.int64))
    y = torch.tensor(np.stack([val[s + 1 : s + seq + 1] for s in starts]).astype(np.int64))
    with torch.inference_mode():
        logits = model(x)[..., :256]
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    return math.exp(float(loss))


def tokens_per_s(model: Any, prompts: list[list[int]], batch: int, new: int) -> float:
    from hpcml.serve.generate.engine import Engine, EngineConfig
    from hpcml.serve.generate.sampling import SamplingParams

    blocks = sum(-(-(len(p) + new) // 16) for p in prompts) + 16
    engine = Engine(
        model,
        EngineConfig(
            kv_cache_blocks=blocks, block_size=16, max_num_seqs=batch, max_batched_tokens=512
        ),
    )
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0))
    dt = time.perf_counter() - t0
    return sum(len(o) for o in out) / dt


def main() -> None:
    a = arguments()
    from hpcml.models.export import load_export
    from hpcml.serve.generate.quantize import linear_weight_bytes, quantize_int8

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        export, corpus = train(Path(tmp), a.train_steps)
        print(f"trained {a.train_steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
        val = np.fromfile(corpus / "val.bin", dtype=np.uint16)
        fp32, _ = load_export(export)
    fp32 = fp32.eval()
    models = {"fp32": fp32, "int8": quantize_int8(copy.deepcopy(fp32))}
    seq = 128
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(val) - 64, size=a.requests)
    prompts = [val[s : s + int(rng.integers(16, 64))].astype(int).tolist() for s in starts]
    ppl = {k: perplexity(m, val, a.windows, seq) for k, m in models.items()}
    print(f"perplexity {ppl}", flush=True)
    runs: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for rep in range(a.repeats + 1):  # the first pass warms up and is not counted
        for k in order[rep % 2 :] + order[: rep % 2]:
            tps = tokens_per_s(models[k], prompts, a.batch, a.new_tokens)
            if rep:
                runs[k].append(tps)
                print(f"repeat {rep} {k}: {tps:,.0f} tokens/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "benchmark": "llm_quantize",
        "command": "python benchmarks/llm_quantize.py " + " ".join(sys.argv[1:]),
        "note": a.note,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torchao": _version("torchao"),
        },
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "perplexity": ppl,
        "linear_weight_bytes": {k: linear_weight_bytes(m) for k, m in models.items()},
        "tokens_per_s": runs,
        "median_tokens_per_s": med,
        "int8_over_fp32_tokens_per_s": med["int8"] / med["fp32"],
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "llm_quantize.json").write_text(json.dumps(result, indent=1))
    (a.out / "llm_quantize.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"gpt 4 x 128 (bytes) trained {s['train_steps']} steps on stdlib sources; perplexity on "
        f"{s['windows']} validation windows of 128; tokens/s: {s['requests']} greedy requests of "
        f"{s['new_tokens']} tokens, batch {s['batch']}, hpcml's engine, median [min .. max] of "
        f"{s['repeats']}, {r['machine']['cpus']} CPU threads."
        + (f" Note: {r['note']}" if r["note"] else ""),
        "",
        "| weights | Linear weight bytes | perplexity | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for k in ("fp32", "int8"):
        v = r["tokens_per_s"][k]
        lines.append(
            f"| {k} | {r['linear_weight_bytes'][k]:,} | {r['perplexity'][k]:.3f} | "
            f"{statistics.median(v):,.0f} [{min(v):,.0f} .. {max(v):,.0f}] |"
        )
    lines.append("")
    lines.append(f"int8 / fp32 tokens/s: {r['int8_over_fp32_tokens_per_s']:.2f}x")
    return "\n".join(lines) + "\n"


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
