"""What tracing costs every run: the fake-tensor trace of the run's config (train.plan_trace,
taken from the per-user cache after the first run of a config) and the allocation tracing of
one real step (hpcml.train.peaktrace), in CPU seconds of this process.

For each zoo model at the test suite's sizes (one process, fp32, AdamW):
- `trace cold`: `summary_trace` with an empty cache (traces and stores), the first call in a
  fresh process, as in every `hpcml train` (its imports and first-call costs included);
- `trace cached`: the same in another fresh process, the cache now holding the trace (the
  key, from the config and the source of the model's classes, and one JSON read);
- `step` and `step traced`: one steady training step without and with the step-peak tracer,
  interleaved in pairs so that the machine's load hits both alike; the difference of their
  medians is what a run pays once.

Medians of REPEATS with [min .. max]; CPU time (time.process_time), which other jobs on a
shared machine move less than wall time; the load average is recorded beside them.

    PYTHONPATH=src python benchmarks/plan_trace_cost.py [--repeats 5] [--out benchmarks/results]

Writes plan_trace_cost.json and plan_trace_cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SYNTH = {"source": "synthetic", "synthetic_samples": 64}
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {
        "model": {"name": "mlp"},
        "data": {**SYNTH, "synthetic_shape": [3, 32, 32], "batch_size": 32},
    },
    "simple_cnn": {
        "model": {"name": "simple_cnn"},
        "data": {**SYNTH, "synthetic_shape": [3, 32, 32], "batch_size": 8},
    },
    "resnet18": {
        "model": {"name": "resnet18"},
        "data": {**SYNTH, "synthetic_shape": [3, 32, 32], "batch_size": 4},
    },
    # data.path: a small pystdlib corpus, written at start
    "gpt-tiny": {
        "model": {"name": "gpt-tiny"},
        "data": {"source": "tokens", "seq_len": 64, "batch_size": 4},
    },
}


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _cpu(fn: Any) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _config(name: str) -> Any:
    from hpcml.config import build_config

    return build_config({**MODELS[name], "precision": "fp32", "train": {"max_steps": 4}})


def child(name: str) -> None:
    """In a fresh process (as every `hpcml train` is): the CPU seconds of the run's
    summary_trace call, its first in the process, against the cache in $HPCML_CACHE_DIR."""
    from hpcml.train.memtrace import summary_trace
    from hpcml.train.validate import resolve

    cfg = _config(name)
    res = resolve(cfg, 1)
    t0 = time.process_time()
    out = summary_trace(cfg, res, 1) or {}
    print(json.dumps({"cpu_s": time.process_time() - t0, "source": out.get("source")}))


def _in_child(name: str, cache: str) -> tuple[float, str]:
    env = {**os.environ, "HPCML_CACHE_DIR": cache, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--corpus", os.environ["HPCML_BENCH_CORPUS"]],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["cpu_s"]), str(got["source"])


def measure(name: str, repeats: int) -> dict[str, Any]:
    import torch

    from hpcml.models.memtrace import run_step
    from hpcml.train.losses import resolve_loss
    from hpcml.train.peaktrace import StepPeak
    from hpcml.train.schedule import build_optimizer, param_groups
    from hpcml.train.validate import resolve

    cfg = _config(name)
    res = resolve(cfg, 1)
    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            cpu, source = _in_child(name, cache)
            assert source == "traced", source
            cold.append(cpu)
            cpu, source = _in_child(name, cache)
            assert source == "cache", source
            warm.append(cpu)
    from hpcml.models.zoo import build_model

    model = build_model(cfg.model.name, res.model_args).train()
    opt = build_optimizer(param_groups(model, cfg.optim), cfg.optim, 1)
    loss = resolve_loss(cfg.train.loss)
    shape = (cfg.data.batch_size, *res.splits.input_shape)

    def batch() -> list[Any]:
        if res.splits.input_dtype.startswith("int"):
            x = torch.zeros(shape, dtype=torch.int64)
        else:
            x = torch.randn(shape)
        y = torch.zeros((cfg.data.batch_size, *res.splits.target_shape), dtype=torch.int64)
        return [(x, y)]

    def traced_step(peak: Any) -> None:
        with peak.step(1):
            run_step(model, opt, batch(), loss)

    for _ in range(3):  # warm-up: optimizer states, first-call costs
        run_step(model, opt, batch(), loss)
    plain, traced = [], []
    for _ in range(repeats):
        plain.append(_cpu(lambda: run_step(model, opt, batch(), loss)))
        traced.append(_cpu(lambda: traced_step(StepPeak(model, opt, last=1, enabled=True))))
    return {
        "model": name,
        "trace_cold_cpu_s": _spread(cold),
        "trace_cached_cpu_s": _spread(warm),
        "step_cpu_s": _spread(plain),
        "step_traced_cpu_s": _spread(traced),
        "step_tracing_added_cpu_s": statistics.median(traced) - statistics.median(plain),
    }


def _cell(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.1f} .. {s['max'] * 1e3:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.corpus:
            MODELS["gpt-tiny"]["data"]["path"] = a.corpus
        child(a.child)
        return
    import torch

    from hpcml.data.sources.tokens import prepare_pystdlib

    torch.set_num_threads(1)
    corpus = Path(tempfile.mkdtemp()) / "corpus"
    prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=200_000)
    MODELS["gpt-tiny"]["data"]["path"] = str(corpus)
    os.environ["HPCML_BENCH_CORPUS"] = str(corpus)
    load_before = os.getloadavg()
    rows = [measure(name, a.repeats) for name in MODELS]
    result = {
        "command": f"PYTHONPATH=src python benchmarks/plan_trace_cost.py --repeats {a.repeats}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_before_after": [load_before, os.getloadavg()],
        "torch_threads": 1,
        "rows": rows,
    }
    lines = [
        "| model | trace, cold cache (CPU ms) | trace, cached (CPU ms) | step (CPU ms) "
        "| step, traced (CPU ms) | added by tracing the step (CPU ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {_cell(r['trace_cold_cpu_s'])} | {_cell(r['trace_cached_cpu_s'])} "
            f"| {_cell(r['step_cpu_s'])} | {_cell(r['step_traced_cpu_s'])} "
            f"| {r['step_tracing_added_cpu_s'] * 1e3:.1f} |"
        )
    lines.append(
        f"\nMedian [min .. max] of {a.repeats}; load average (1, 5, 15 min) "
        f"{load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} before."
    )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "plan_trace_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "plan_trace_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
