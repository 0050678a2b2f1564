"""What watching inputs for drift costs: the request path (`DriftMonitor.observe`, per request),
one periodic check (fold the pending rows into the live window, PSI and the chi-square test
against the reference) and the reference profile `hpcml train` writes (the default
`data.drift_reference_samples`: every digits training input, the set being under 10,000).

    python benchmarks/drift_cost.py [--repeats 7]

Absolute costs on this machine (no peer to compare with), medians and spread over repeats.
Writes benchmarks/results/drift_cost.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.config import DataConfig
from hpcml.data.drift import REFERENCE_SAMPLES, build_profile, profile_dataset
from hpcml.data.sources import load_source
from hpcml.serve.config import DriftConfig
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.traffic.drift import DriftMonitor, Watched

OUT = Path(__file__).parent / "results"
SHAPE = (3, 32, 32)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(repeats: int, requests: int = 512, rows: int = 8) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    ref = build_profile(rng.normal(size=(REFERENCE_SAMPLES, *SHAPE)))
    cfg = DriftConfig(max_pending_rows=requests * rows)
    monitor = DriftMonitor(cfg, ServeMetrics())
    w = monitor.watched[("m", "1")] = Watched("m", "1", ref)
    x = rng.normal(size=(rows, *SHAPE)).astype(np.float32)
    monitor.check(w)  # imports (scipy) outside the timings
    observe_us, check_ms, reference_ms = [], [], []
    splits = load_source(DataConfig(source="digits"))
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(requests):
            monitor.observe("m", "1", x)
        observe_us.append((time.perf_counter() - t) / requests * 1e6)
        t = time.perf_counter()
        monitor.check(w)
        check_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        profile_dataset(splits.train)
        reference_ms.append((time.perf_counter() - t) * 1e3)
    return {
        "setup": {
            "input_shape": list(SHAPE),
            "rows_per_request": rows,
            "pending_rows_per_check": requests * rows,
            "max_values_per_check": cfg.max_values_per_check,
            "window_rows": cfg.window_rows,
            "reference_inputs": min(REFERENCE_SAMPLES, len(splits.train)),
            "repeats": repeats,
            "machine": platform.processor() or platform.machine(),
        },
        "observe_per_request_us": spread(observe_us),
        "check_ms": spread(check_ms),
        "reference_profile_ms": spread(reference_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    result = measure(parser.parse_args().repeats)
    OUT.mkdir(exist_ok=True)
    (OUT / "drift_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| what | median | min | max |", "|---|---|---|---|"]
    for key, label in (
        ("observe_per_request_us", "request path, per request (us)"),
        ("check_ms", "one check, 4096 pending 3x32x32 rows (ms)"),
        ("reference_profile_ms", "reference profile, every digits training input (ms)"),
    ):
        s = result[key]
        lines.append(f"| {label} | {s['median']:.3g} | {s['min']:.3g} | {s['max']:.3g} |")
    table = "\n".join(lines) + "\n"
    (OUT / "drift_cost.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
