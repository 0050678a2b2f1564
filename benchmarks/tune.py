"""ASHA + TPE against random search without pruning, on the digits demo
(examples/tune_digits.yaml): the same number of trials of the same length each (an equal
budget of training steps offered), through the real `hpcml tune`, one worker. Per arm and seed:
the best validation accuracy reached, the wall time of the whole tune, and the training steps
the trials actually ran (a pruned trial stops early); then the median and the spread (min to
max) over the seeds.

    python benchmarks/tune.py [--trials 6] [--steps 120] [--seeds 0 1 2] [--workers 1]

Writes benchmarks/results/tune.json and .md. A trial's wall time includes its process start
(importing torch), which pruning does not save: the shorter the trials, the less pruning can
cut the total.
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
CONFIG = ROOT / "examples" / "tune_digits.yaml"
ARMS = {"asha+tpe": ("tpe", "asha"), "random, no pruning": ("random", "none")}


def steps_ran(run: Path) -> int:
    steps = [0]
    for line in (run / "run.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            steps.append(int(rec["step"]))
    return max(steps)


def tune(sampler: str, pruner: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-tune-") as tmp:
        out = Path(tmp) / "study"
        cmd = [
            sys.executable, "-m", "hpcml", "tune", str(CONFIG), f"tune.sampler={sampler}",
            f"tune.pruner={pruner}", f"tune.seed={seed}", f"train.max_steps={args.steps}",
            "--trials", str(args.trials), "--workers", str(args.workers), "--out", str(out),
            "--json",
        ]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.splitlines()[-1])
        steps = sum(steps_ran(run) for run in (out / "trials").iterdir())
    return {
        "seed": seed,
        "best_val_accuracy": result["best_value"],
        "wall_s": round(wall, 2),
        "steps_trained": steps,
        "trials": result["trials"],
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in args.seeds:  # arms interleaved, so a change in machine load hits both
        for arm, (sampler, pruner) in ARMS.items():
            runs[arm].append(tune(sampler, pruner, seed, args))
            print(arm, runs[arm][-1], flush=True)
    summary = {
        arm: {
            key: spread([float(r[key]) for r in rs])
            for key in ("best_val_accuracy", "wall_s", "steps_trained")
        }
        for arm, rs in runs.items()
    }
    a, r = summary["asha+tpe"], summary["random, no pruning"]
    out = {
        "what": "hpcml tune on examples/tune_digits.yaml: ASHA + TPE vs random search without "
        "pruning, equal trials and steps per trial",
        "command": "python benchmarks/tune.py " + " ".join(sys.argv[1:]),
        "trials": args.trials,
        "max_steps": args.steps,
        "workers": args.workers,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "runs": runs,
        "summary": summary,
        "wall_ratio_median": a["wall_s"]["median"] / r["wall_s"]["median"],
        "steps_ratio_median": a["steps_trained"]["median"] / r["steps_trained"]["median"],
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tune.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "tune.md").write_text(markdown(out))
    print(markdown(out))


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "# hpcml tune: ASHA + TPE vs random search without pruning",
        "",
        f"`{out['command']}`: {out['trials']} trials of at most {out['max_steps']} steps per arm "
        f"and seed, {out['workers']} worker; median (min to max) over the seeds. Machine: "
        f"{out['machine']['cpu_count']} cores, load average at the end "
        f"{out['machine']['load_average_at_end'][0]:.1f}.",
        "",
        "| arm | best val_accuracy | wall time (s) | steps trained |",
        "|---|---|---|---|",
    ]
    for arm, s in out["summary"].items():
        cells = [
            f"{s[k]['median']:.4g} ({s[k]['min']:.4g} to {s[k]['max']:.4g})"
            for k in ("best_val_accuracy", "wall_s", "steps_trained")
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Wall time ratio (median, ASHA + TPE / random): {out['wall_ratio_median']:.2f}; "
        f"steps trained ratio: {out['steps_ratio_median']:.2f}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
