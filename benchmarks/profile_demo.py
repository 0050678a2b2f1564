"""The workshop's Demo 4 with `hpcml profile`: where a step of the demo model goes, and what one
change does to it.

simple_cnn on the digits (upsampled to 3x32x32, random crop and flip on: `data.augment`),
batch 64, one process: the baseline and one change at a time (data-loading workers, channels-
last memory format, bf16 autocast). Each variant is profiled `--repeats` times, variants in a
rotating order per repetition so machine noise hits each alike; every profile records 6 steps
after 3 skipped ones. Reported per variant: the median profiled step time, its spread, and the
median shares of the step spent waiting for data, in compute (forward, backward, optimizer)
and in the rest (hpcml.train.profile's breakdown); and the step-time ratio to the baseline.

    python benchmarks/profile_demo.py [--repeats 3]

Writes benchmarks/results/profile_demo.{json,md}.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BASE = ["data.augment=true", "data.batch_size=64"]
VARIANTS = {
    "baseline": [],
    "num_workers=2": ["data.num_workers=2"],
    "channels_last": ["train.channels_last=true"],
    "bf16": ["precision=bf16"],
}


def profile_once(overrides: list[str], run_dir: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "hpcml",
        "profile",
        str(ROOT / "examples" / "digits_cnn.yaml"),
        *BASE,
        *overrides,
        "--steps",
        "6",
        "--run-dir",
        str(run_dir),
        "--overwrite",
        "--quiet",
        "--json",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    return dict(json.loads(out.stdout)["profile"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="profile-demo-") as tmp:
        for rep in range(a.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                b = profile_once(VARIANTS[name], Path(tmp) / f"{name}-{rep}")
                runs[name].append(b)
                print(
                    f"repeat {rep + 1} {name:14s} step {b['step_s'] * 1e3:7.1f} ms  data "
                    f"{b['data_share']:.1%}  compute {b['compute_share']:.1%}",
                    flush=True,
                )
    base = statistics.median(r["step_s"] for r in runs["baseline"])
    rows = []
    for name in names:
        steps = [r["step_s"] for r in runs[name]]
        rows.append(
            {
                "variant": name,
                "overrides": VARIANTS[name],
                "step_ms_median": statistics.median(steps) * 1e3,
                "step_ms_min": min(steps) * 1e3,
                "step_ms_max": max(steps) * 1e3,
                "vs_baseline": statistics.median(steps) / base,
                **{
                    f"{k}_share_median": statistics.median(r[f"{k}_share"] for r in runs[name])
                    for k in ("data", "compute", "other")
                },
            }
        )
    result = {
        "benchmark": "profile_demo",
        "command": "python benchmarks/profile_demo.py " + " ".join(sys.argv[1:]),
        "config": "examples/digits_cnn.yaml " + " ".join(BASE),
        "note": a.note,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "rows": rows,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "profile_demo.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "| variant | step ms, median [min .. max] | vs baseline | data wait | compute | other |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['step_ms_median']:.0f} [{r['step_ms_min']:.0f} .. "
            f"{r['step_ms_max']:.0f}] | {r['vs_baseline']:.2f}x | {r['data_share_median']:.1%} | "
            f"{r['compute_share_median']:.1%} | {r['other_share_median']:.1%} |"
        )
    (RESULTS / "profile_demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
