"""Checkpoint cost as a run pays it: synchronous vs asynchronous saves, side by side.

Real runs of the engine in one invocation, in rounds: each round trains the same model with no
checkpoints (baseline), with checkpoints every K steps written synchronously, and with the same
written in the background (train.checkpoint_async) by a writer thread at training's priority
(`async_nice0`) and below it (`async_nice19`, train.checkpoint_writer_nice=19; the default is 0).
The order of the modes rotates from round to round so that machine noise hits all alike. Per
checkpoint it reports
  stall_s     the time the loop was blocked inside the save (waiting for the previous
              background save included)
  added_s     (loop time of the run - loop time of the same round's baseline) / checkpoints:
              what each checkpoint added to the run, background interference included
  added_within_run_s  the same measured inside each run: its loop time beyond (steps x its own
              median step), less the baseline's, per checkpoint; load that changes between
              runs cancels, so on a shared machine it is the steadier of the two
  durable_s   the time until the checkpoint was complete on disk (renamed into place)
with medians and spread (min - max) and each mode's ratios to sync, and the load average
beside every run.

    python benchmarks/checkpoint_stall.py [--hidden 2048] [--depth 4] [--steps 60] [--every 10]
                                          [--rounds 3] [--modes sync async_nice0 async_nice19]

Writes benchmarks/results/checkpoint_stall_<device>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcml.config import load_config
from hpcml.records import read_run_log
from hpcml.train.checkpoint import store as ckpt
from hpcml.train.engine import run as hpcml_run

RESULTS = Path(__file__).resolve().parent / "results"
MODES: dict[str, list[str]] = {
    "sync": ["train.checkpoint_async=false"],
    "async_nice0": ["train.checkpoint_async=true", "train.checkpoint_writer_nice=0"],
    "async_nice19": ["train.checkpoint_async=true", "train.checkpoint_writer_nice=19"],
}


def one_run(overrides: list[str], every: int) -> dict[str, Any]:
    cfg = load_config(None, [*overrides, f"train.checkpoint_every={every}"])
    start = len(ckpt.timings)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = hpcml_run(cfg, run_dir=Path(tmp) / "run", quiet=True)
        steps = [
            r for r in read_run_log(Path(tmp) / "run" / "run.jsonl") if r.get("kind") == "step"
        ]
        folders = list((Path(tmp) / "run" / "checkpoints").glob("step-*"))
        ckpt_bytes = sum(f.stat().st_size for d in folders for f in d.rglob("*") if f.is_file())
    # The final checkpoint (at the last step) is outside the loop time: leave it out.
    saves = [t for t in ckpt.timings[start:] if t.step < cfg.train.max_steps]
    times = [r["time"] for r in steps]
    step_s = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        # From the end of step 1 (warm-up) to the end of the last step.
        "loop_s": times[-1] - times[0],
        # The loop time beyond its own median step: what the checkpoints (and noise) added,
        # measured within the run, so load that changes between runs cancels.
        "excess_s": times[-1] - times[0] - len(step_s) * statistics.median(step_s),
        "checkpoints": len(saves),
        "stall_s": [t.stall_s for t in saves],
        "durable_s": [t.total_s for t in saves if t.total_s is not None],
        "checkpoint_bytes": ckpt_bytes // max(1, len(folders)),
        "params": out["model"]["parameters"],
        "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def mlp_overrides(hidden: int, depth: int, batch: int, steps: int) -> list[str]:
    """The benchmark's run: the zoo MLP on synthetic data, a step record every step."""
    return [
        "model.name=mlp",
        f"model.args={{hidden: {hidden}, depth: {depth}}}",
        "data.source=synthetic",
        "data.synthetic_samples=2048",
        f"data.batch_size={batch}",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "train.log_every=1",
        "train.keep_last=2",
    ]


def run_rounds(
    overrides: list[str],
    modes: list[str],
    every: int,
    rounds: int,
    say: Callable[[int, str, dict[str, Any]], None] | None = None,
) -> list[dict[str, dict[str, Any]]]:
    """`rounds` rounds of a run without checkpoints (baseline) and one per mode, the order
    rotated from round to round so that machine noise hits every mode alike."""
    order = ["baseline", *modes]
    out: list[dict[str, dict[str, Any]]] = []
    for i in range(rounds):
        this_round: dict[str, dict[str, Any]] = {}
        for mode in order[i % len(order) :] + order[: i % len(order)]:
            every_k = 0 if mode == "baseline" else every
            this_round[mode] = one_run([*overrides, *MODES.get(mode, [])], every_k)
            if say is not None:
                say(i, mode, this_round[mode])
        out.append(this_round)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict[str, dict[str, Any]]], modes: list[str]) -> dict[str, Any]:
    """Per mode: stall, time added to the loop per checkpoint (against the same round's
    baseline) and time until durable, each as median (min - max); and each mode's ratio to
    sync: of the medians, and per round (the spread of the ratio)."""
    rows: dict[str, dict[str, Any]] = {}
    added: dict[str, list[float]] = {}
    for mode in modes:
        runs = [r[mode] for r in rounds]
        added[mode] = [
            (r[mode]["loop_s"] - r["baseline"]["loop_s"]) / r[mode]["checkpoints"] for r in rounds
        ]
        within = [
            (r[mode]["excess_s"] - r["baseline"]["excess_s"]) / r[mode]["checkpoints"]
            for r in rounds
            if "excess_s" in r[mode]
        ]
        rows[mode] = {
            "checkpoints_per_run": statistics.median(x["checkpoints"] for x in runs),
            "stall_s": spread([s for x in runs for s in x["stall_s"]]),
            "added_s_per_checkpoint": spread(added[mode]),
            **({"added_within_run_s_per_checkpoint": spread(within)} if within else {}),
            "durable_s": spread([d for x in runs for d in x["durable_s"]]),
            "loop_s": spread([x["loop_s"] for x in runs]),
        }
    ratios: dict[str, dict[str, Any]] = {}
    for mode in modes:
        if mode == "sync" or "sync" not in rows:
            continue
        keys = (
            "stall_s",
            "added_s_per_checkpoint",
            "added_within_run_s_per_checkpoint",
            "durable_s",
        )
        ratios[mode] = {
            key: rows[mode][key]["median"] / rows["sync"][key]["median"]
            for key in keys
            if key in rows[mode] and rows["sync"][key]["median"] > 0
        }
        per_round = [a / s for a, s in zip(added[mode], added["sync"], strict=True) if s > 0]
        if per_round:
            ratios[mode]["added_per_round"] = spread(per_round)
    baseline = spread([r["baseline"]["loop_s"] for r in rounds])
    return {"baseline_loop_s": baseline, "modes": rows, "over_sync": ratios}


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu": model,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = ap.parse_args()

    overrides = mlp_overrides(args.hidden, args.depth, args.batch, args.steps)

    def say(i: int, mode: str, run: dict[str, Any]) -> None:
        print(
            f"round {i + 1} {mode:<13} loop {run['loop_s']:.2f} s (load {run['load_1m']})",
            flush=True,
        )

    rounds = run_rounds(overrides, args.modes, args.every, args.rounds, say)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    first = rounds[0][args.modes[0]]
    loads = [x for r in rounds for run in r.values() for x in run["load_1m"]]
    result = {
        "benchmark": "checkpoint_stall",
        "question": "What does a checkpoint cost a training run, written synchronously or in "
        "the background: the time the loop is blocked, the time it adds to the run, and the "
        "time until it is durable?",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "machine": machine(),
        "load_1m": {"min": min(loads), "max": max(loads)},
        "params": first["params"],
        "checkpoint_bytes": first["checkpoint_bytes"],
        "steps": args.steps,
        "every": args.every,
        "rounds": args.rounds,
        **summarize(rounds, args.modes),
        "runs": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"checkpoint_stall_{device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"wrote {out}")
    plot(result, RESULTS / f"checkpoint_stall_{device}.png")


def _cell(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def report(result: dict[str, Any]) -> None:
    mb = result["checkpoint_bytes"] / 2**20
    print(
        f"checkpoint cost: MLP {result['params'] / 1e6:.1f} M parameters, {mb:.0f} MiB per "
        f"checkpoint, {result['steps']} steps, every {result['every']}, {result['rounds']} "
        f"rounds ({result['device']}, load {result['load_1m']['min']}-"
        f"{result['load_1m']['max']}); seconds, median (min-max)"
    )
    print(
        f"{'mode':<14}{'stall':>20}{'added to the loop':>20}{'added, in-run':>20}"
        f"{'durable after':>20}"
    )
    for mode, r in result["modes"].items():
        within = r.get("added_within_run_s_per_checkpoint")
        print(
            f"{mode:<14}{_cell(r['stall_s']):>20}{_cell(r['added_s_per_checkpoint']):>20}"
            f"{_cell(within) if within else '-':>20}{_cell(r['durable_s']):>20}"
        )
    for mode, q in result["over_sync"].items():
        print(
            f"{mode} / sync: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in q.items() if k != "added_per_round")
        )
    print(f"baseline loop {_cell(result['baseline_loop_s'])} s")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    rows = result["modes"]
    keys = [
        ("stall_s", "loop blocked in the save"),
        ("added_s_per_checkpoint", "loop time added (vs baseline run)"),
        ("added_within_run_s_per_checkpoint", "loop time added (in-run)"),
        ("durable_s", "until durable"),
    ]
    keys = [(k, label) for k, label in keys if k in rows[modes[0]]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(modes))]
        med = [rows[m][key]["median"] for m in modes]
        err = [
            [med[i] - rows[m][key]["min"] for i, m in enumerate(modes)],
            [rows[m][key]["max"] - med[i] for i, m in enumerate(modes)],
        ]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=label)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("seconds per checkpoint (median, min-max)")
    ax.set_title(
        f"checkpoint cost, {result['checkpoint_bytes'] / 2**20:.0f} MiB "
        f"({result['device']}, load {result['load_1m']['min']}-{result['load_1m']['max']})",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
