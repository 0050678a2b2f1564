"""Checkpoint stall: how long training stops per checkpoint, synchronous vs asynchronous
(train.checkpoint_async, torch.distributed.checkpoint.async_save), side by side.

Three real runs of the engine per round, in one invocation and alternating so that machine
noise hits all alike: no checkpoints in the loop (baseline), checkpoints every K steps written
synchronously, and the same written in the background. Per checkpoint it reports
  stall_s     the time the loop was blocked inside the save (measured in checkpoint.save)
  durable_s   the time until the checkpoint was complete on disk (renamed into place)
  overhead_s  (loop time of the run - loop time of the baseline) / checkpoints: what each
              checkpoint really cost the training, background interference included

    python benchmarks/checkpoint_stall.py [--hidden 2048] [--depth 4] [--steps 60] [--every 10]

Writes benchmarks/results/checkpoint_stall_<device>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from hpcml.config import load_config
from hpcml.records import read_run_log
from hpcml.train.checkpoint import store as ckpt
from hpcml.train.engine import run as hpcml_run

RESULTS = Path(__file__).resolve().parent / "results"


def one_run(overrides: list[str], every: int, background: bool) -> dict[str, Any]:
    cfg = load_config(
        None,
        [*overrides, f"train.checkpoint_every={every}", f"train.checkpoint_async={background}"],
    )
    start = len(ckpt.timings)
    with tempfile.TemporaryDirectory() as tmp:
        out = hpcml_run(cfg, run_dir=Path(tmp) / "run", quiet=True)
        steps = [r for r in read_run_log(Path(tmp) / "run" / "run.jsonl") if r.get("kind") == "step"]
        ckpt_bytes = sum(
            f.stat().st_size for f in (Path(tmp) / "run" / "checkpoints").rglob("*") if f.is_file()
        ) // max(1, len(list((Path(tmp) / "run" / "checkpoints").glob("step-*"))))
    # The final checkpoint (at the last step) is outside the loop time: leave it out.
    saves = [t for t in ckpt.timings[start:] if t.step < cfg.train.max_steps]
    return {
        # From the end of step 1 (warm-up) to the end of the last step.
        "loop_s": steps[-1]["time"] - steps[0]["time"],
        "checkpoints": len(saves),
        "stall_s": [t.stall_s for t in saves],
        "durable_s": [t.total_s for t in saves],
        "checkpoint_bytes": ckpt_bytes,
        "params": out["model"]["parameters"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()

    overrides = [
        "model.name=mlp",
        f"model.args={{hidden: {args.hidden}, depth: {args.depth}}}",
        "data.source=synthetic",
        "data.synthetic_samples=2048",
        f"data.batch_size={args.batch}",
        f"train.max_steps={args.steps}",
        "train.eval_every=0",
        "train.log_every=1",
        "train.keep_last=2",
    ]
    modes = {"baseline": (0, False), "sync": (args.every, False), "async": (args.every, True)}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, (every, background) in modes.items():
            runs[mode].append(one_run(overrides, every, background))

    base_loop = statistics.median(r["loop_s"] for r in runs["baseline"])
    rows: dict[str, dict[str, Any]] = {}
    for mode in ("sync", "async"):
        stalls = [s for r in runs[mode] for s in r["stall_s"]]
        durable = [d for r in runs[mode] for d in r["durable_s"] if d is not None]
        n = statistics.median(r["checkpoints"] for r in runs[mode])
        loop = statistics.median(r["loop_s"] for r in runs[mode])
        rows[mode] = {
            "checkpoints_per_run": n,
            "stall_s_median": statistics.median(stalls),
            "stall_s_max": max(stalls),
            "durable_s_median": statistics.median(durable) if durable else None,
            "loop_s_median": loop,
            "overhead_s_per_checkpoint": (loop - base_loop) / n if n else None,
        }
    ratio = rows["async"]["stall_s_median"] / rows["sync"]["stall_s_median"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "benchmark": "checkpoint_stall",
        "device": device,
        "host": platform.node(),
        "torch": torch.__version__,
        "params": runs["sync"][0]["params"],
        "checkpoint_bytes": runs["sync"][0]["checkpoint_bytes"],
        "steps": args.steps,
        "every": args.every,
        "rounds": args.rounds,
        "baseline_loop_s_median": base_loop,
        "modes": rows,
        "async_over_sync_stall": ratio,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"checkpoint_stall_{device}.json"
    out.write_text(json.dumps(result, indent=2))

    mb = result["checkpoint_bytes"] / 2**20
    print(f"checkpoint stall: MLP {result['params'] / 1e6:.1f} M parameters, {mb:.0f} MiB per "
          f"checkpoint, {args.steps} steps, every {args.every}, {args.rounds} rounds ({device})")
    print(f"{'mode':<7}{'stall median':>14}{'stall max':>12}{'durable after':>15}"
          f"{'cost/ckpt in loop':>19}")
    for mode, r in rows.items():
        durable = f"{r['durable_s_median']:.3f} s" if r["durable_s_median"] is not None else "-"
        cost = r["overhead_s_per_checkpoint"]
        print(f"{mode:<7}{r['stall_s_median']:>12.3f} s{r['stall_s_max']:>10.3f} s"
              f"{durable:>15}{cost:>17.3f} s")
    print(f"async / sync stall: {ratio:.3f}   (baseline loop {base_loop:.2f} s)")
    print(f"wrote {out}")
    plot(result, RESULTS / f"checkpoint_stall_{device}.png")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["sync", "async"]
    rows = result["modes"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], [rows[m]["stall_s_median"] for m in modes], 0.4,
           label="loop blocked in save (median)")
    ax.bar([i + 0.2 for i in x], [rows[m]["overhead_s_per_checkpoint"] for m in modes], 0.4,
           label="loop time added per checkpoint")
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("seconds per checkpoint")
    ax.set_title(f"checkpoint stall, {result['checkpoint_bytes'] / 2**20:.0f} MiB ({result['device']})")
    top = max(max(rows[m]["stall_s_median"], rows[m]["overhead_s_per_checkpoint"] or 0)
              for m in modes)
    ax.set_ylim(0, top * 1.4)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
