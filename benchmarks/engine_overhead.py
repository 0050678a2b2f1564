"""Engine overhead: hpcml's training engine vs a minimal hand-written PyTorch loop and the
same loop under Lightning Fabric (`pip install hpcml[bench]`; left out when not installed).

Same model, data, batch, optimizer, schedule and precision; runs alternate in one invocation
(hpcml, plain, fabric; then plain, fabric, hpcml; ...: the order rotates every round) so
machine noise and drift hit all alike. Throughput is measured the
same way for both: wall-clock between the end of warm-up step W and the end of step N,
everything in between included (logging, flushes), divided into (N - W) x batch samples.
The whole-process wall time of each run (set-up, data, the loop, hpcml's end-of-run evaluation
and summary) is compared the same way, as its inverse (runs per second).

Rounds go on until the 95% bootstrap interval of each median pair ratio is within +-1%
(`--resolve 0.01`), after `--pairs` rounds at least and `--max-pairs` at most.

    python benchmarks/engine_overhead.py [--model simple_cnn] [--steps 60] [--pairs 5]

Writes benchmarks/results/engine_overhead_<device>.json and prints a table. Goal: ratio >= 0.99.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hpcml.config import load_config
from hpcml.data.sources import load_source
from hpcml.models.zoo import build_model, complete_args
from hpcml.records import read_run_log
from hpcml.train.engine import run as hpcml_run
from hpcml.train.schedule import build_optimizer, build_scheduler

RESULTS = Path(__file__).resolve().parent / "results"


def hpcml_throughput(overrides: list[str], warmup: int) -> float:
    cfg = load_config(None, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        hpcml_run(cfg, run_dir=Path(tmp) / "run", quiet=True)
        steps = [r for r in read_run_log(Path(tmp) / "run" / "run.jsonl") if r.get("kind") == "step"]
    t_w = next(r["time"] for r in steps if r["step"] == warmup)
    t_n = steps[-1]["time"]
    return (steps[-1]["step"] - warmup) * cfg.data.batch_size / (t_n - t_w)


def plain_throughput(overrides: list[str], warmup: int, fabric: bool = False) -> float:
    """What a user writes by hand: DataLoader, model, AdamW, cosine LR, loss.item() per step;
    with `fabric`, the same loop with Lightning Fabric owning device, precision and backward."""
    cfg = load_config(None, overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.train.seed)
    splits = load_source(cfg.data)
    args = complete_args(cfg.model.name, cfg.model.args, splits.input_shape, splits.num_classes)
    model = build_model(cfg.model.name, args).to(device)
    opt = build_optimizer(model.parameters(), cfg.optim, 1)
    sched = build_scheduler(opt, cfg.optim, cfg.train.max_steps)
    loader = torch.utils.data.DataLoader(
        splits.train, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True,
        pin_memory=device.type == "cuda",
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    backward = torch.Tensor.backward
    autocast: Any = lambda: torch.autocast(  # noqa: E731
        device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    )
    if fabric:
        from lightning.fabric import Fabric

        names = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
        fab = Fabric(accelerator=device.type, devices=1, precision=names[cfg.precision])  # type: ignore[arg-type]
        model, opt = fab.setup(model, opt)
        loader = fab.setup_dataloaders(loader)
        backward, autocast = fab.backward, contextlib.nullcontext  # Fabric's model autocasts
    step, times = 0, {}
    model.train()
    while step < cfg.train.max_steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = F.cross_entropy(model(x), y)
            backward(loss)
            opt.step()
            sched.step()
            loss.item()
            step += 1
            times[step] = time.time()
            if step >= cfg.train.max_steps:
                break
    return (step - warmup) * cfg.data.batch_size / (times[step] - times[warmup])


def median_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float]:
    """Bootstrap interval of the median (seeded: the same numbers give the same interval)."""
    rng = random.Random(0)
    meds = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000)
    )
    lo = meds[int((1 - level) / 2 * len(meds))]
    hi = meds[int((1 + level) / 2 * len(meds)) - 1]
    return lo, hi


def timed(fn: Any, into: list[float]) -> Any:
    """Run `fn`, appending its whole wall time to `into`; returns its result."""
    t0 = time.perf_counter()
    out = fn()
    into.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="simple_cnn")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=5, help="rounds at least")
    ap.add_argument("--max-pairs", type=int, default=30, help="rounds at most")
    ap.add_argument("--resolve", type=float, default=0.01,
                    help="stop once every median ratio's 95%% interval is within +- this")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    overrides = [
        f"model.name={a.model}", f"data.source={a.data}", f"data.batch_size={a.batch}",
        f"train.max_steps={a.steps}", "train.eval_every=0", "train.checkpoint_every=0",
        f"precision={a.precision}", "train.log_every=10",
    ]
    with_fabric = importlib.util.find_spec("lightning") is not None
    hp: list[float] = []
    pl: list[float] = []
    fb: list[float] = []
    wall: dict[str, list[float]] = {"hpcml": [], "plain": [], "fabric": []}
    runners = [
        lambda: hp.append(timed(lambda: hpcml_throughput(overrides, a.warmup), wall["hpcml"])),
        lambda: pl.append(timed(lambda: plain_throughput(overrides, a.warmup), wall["plain"])),
    ]
    if with_fabric:
        runners.append(lambda: fb.append(timed(
            lambda: plain_throughput(overrides, a.warmup, fabric=True), wall["fabric"])))

    def all_ratios() -> dict[str, list[float]]:
        out = {
            "hpcml_over_plain": [h / p for h, p in zip(hp, pl, strict=True)],
            "wall_hpcml_over_plain": [
                p / h for h, p in zip(wall["hpcml"], wall["plain"], strict=True)
            ],
        }
        if fb:
            out["hpcml_over_fabric"] = [h / f for h, f in zip(hp, fb, strict=True)]
            out["wall_hpcml_over_fabric"] = [
                f / h for h, f in zip(wall["hpcml"], wall["fabric"], strict=True)
            ]
        return out

    i = 0
    while i < a.max_pairs:
        # The order rotates every round: a drift of the machine's speed favours no one.
        for k in range(len(runners)):
            runners[(i + k) % len(runners)]()
        i += 1
        fabric_note = f"  fabric {fb[-1]:,.1f}" if fb else ""
        print(f"round {i}: hpcml {hp[-1]:,.1f}  plain {pl[-1]:,.1f}{fabric_note} samples/s",
              file=sys.stderr)
        if i >= a.pairs:
            widths = [hi - lo for lo, hi in map(median_interval, all_ratios().values())]
            if max(widths) / 2 <= a.resolve:
                break
    ratios_by = all_ratios()
    intervals = {k: median_interval(v) for k, v in ratios_by.items()}
    resolved = all((hi - lo) / 2 <= a.resolve for lo, hi in intervals.values())
    ratios = ratios_by["hpcml_over_plain"]
    fabric_ratios = ratios_by.get("hpcml_over_fabric", [])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {
        "benchmark": "engine_overhead",
        "command": "python benchmarks/engine_overhead.py " + " ".join(sys.argv[1:]),
        "device": device,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "settings": vars(a),
        "hpcml_samples_per_s": hp,
        "plain_samples_per_s": pl,
        "pair_ratios": ratios,
        "median_hpcml": statistics.median(hp),
        "median_plain": statistics.median(pl),
        "ratio_of_medians": statistics.median(hp) / statistics.median(pl),
        "median_pair_ratio": statistics.median(ratios),
        "fabric_samples_per_s": fb,
        "hpcml_over_fabric_ratios": fabric_ratios,
        "median_hpcml_over_fabric": statistics.median(fabric_ratios) if fb else None,
        "wall_s": wall,
        "median_ratios": {k: statistics.median(v) for k, v in ratios_by.items()},
        "median_ratio_intervals_95": intervals,
        "rounds": i,
        "resolved_to": a.resolve if resolved else None,
        "date": time.strftime("%Y-%m-%d"),
    }
    tag = "cpu" if device == "cpu" else device.replace(" ", "_")
    out = Path(a.out) if a.out else RESULTS / f"engine_overhead_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| device | model | batch | hpcml samples/s | plain samples/s | hpcml/plain | "
          "fabric samples/s | hpcml/fabric |")
    print("|---|---|---|---|---|---|---|---|")
    fab = (f"{statistics.median(fb):,.1f} | {result['median_hpcml_over_fabric']:.3f}"
           if fb else "- | -")
    print(f"| {device} | {a.model} | {a.batch} | {result['median_hpcml']:,.1f} | "
          f"{result['median_plain']:,.1f} | {result['median_pair_ratio']:.3f} | {fab} |")
    for name, (lo, hi) in intervals.items():
        print(f"{name}: median {result['median_ratios'][name]:.3f}, 95% interval "
              f"[{lo:.3f}, {hi:.3f}]")
    print(f"{i} rounds; " + (f"resolved to +-{a.resolve:.0%}" if resolved else
                             f"NOT resolved to +-{a.resolve:.0%} within --max-pairs"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
