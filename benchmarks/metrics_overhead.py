"""Cost of Prometheus training metrics: hpcml with `observe.metrics_port` on and off, same
config, runs alternating in one invocation (off, on, on, off, off, on, ...) so machine noise and
drift hit both alike.
Throughput is measured as in engine_overhead.py (wall clock from the end of warm-up step W to
the end of step N, from the run's own step records).

    python benchmarks/metrics_overhead.py [--model mlp] [--steps 300] [--pairs 7]

Writes benchmarks/results/metrics_overhead.json. Goal: the median on/off pair ratio within the
pairs' spread of 1.0 (metrics are updated at the log flush, never per step). A small model is
the harsh case: its steps are short, so any per-step cost would show most.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import hpcml_throughput  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS / "metrics_overhead.json"))
    a = ap.parse_args()
    base = [
        f"model.name={a.model}", "data.source=digits", f"data.batch_size={a.batch}",
        f"train.max_steps={a.steps}", "train.eval_every=0", "train.checkpoint_every=0",
        f"train.log_every={a.log_every}", "train.device=cpu",
    ]
    on_args = [*base, "observe.metrics_port=0", "observe.metrics_address=127.0.0.1"]
    off, on = [], []
    for i in range(a.pairs):
        # ABBA order: a drift of the machine's speed over the run does not favour either side.
        if i % 2 == 0:
            off.append(hpcml_throughput(base, a.warmup))
            on.append(hpcml_throughput(on_args, a.warmup))
        else:
            on.append(hpcml_throughput(on_args, a.warmup))
            off.append(hpcml_throughput(base, a.warmup))
        print(f"pair {i + 1}/{a.pairs}: off {off[-1]:.0f}  on {on[-1]:.0f} samples/s", flush=True)
    ratios = [b / x for x, b in zip(off, on, strict=True)]
    result = {
        "benchmark": "metrics_overhead",
        "command": " ".join(["python", "benchmarks/metrics_overhead.py", *sys.argv[1:]]),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "settings": vars(a),
        "off_samples_per_s": off,
        "on_samples_per_s": on,
        "pair_ratios_on_over_off": ratios,
        "median_ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "median_off": statistics.median(off),
        "median_on": statistics.median(on),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"on/off: median {result['median_ratio']:.3f} "
        f"(pairs {result['ratio_min']:.3f} .. {result['ratio_max']:.3f}); wrote {a.out}"
    )


if __name__ == "__main__":
    main()
