"""Cost of Prometheus training metrics: hpcml with `observe.metrics_port` on and off, same
config, runs alternating in one invocation (off, on, on, off, off, on, ...) so machine noise and
drift hit both alike. While an "on" run trains, a scraper in another process (as Prometheus
would be) finds its endpoint through the target file and scrapes it every `--scrape-s` seconds,
so the collect path (gauges, histograms, process and host readings; NVML on a GPU) is paid.
Throughput is measured as in engine_overhead.py (wall clock from the end of warm-up step W to
the end of step N, from the run's own step records).

    python benchmarks/metrics_overhead.py [--model mlp] [--steps 300] [--pairs 7]

Writes benchmarks/results/metrics_overhead.json. Goal: the median on/off pair ratio within 1%
of 1.0 (metrics are updated at the log flush, never per step; a scrape reads them). A small
model is the harsh case: its steps are short, so any cost would show most.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import hpcml_throughput  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Prometheus's part: read the target files, GET each target's metrics path, every N seconds.
SCRAPER = r"""
import glob, json, signal, sys, time, urllib.request
# A process started in the background by a shell inherits SIGINT ignored: stop on it anyway.
signal.signal(signal.SIGINT, signal.default_int_handler)
folder, every = sys.argv[1], float(sys.argv[2])
done = took = 0.0
try:
    while True:
        start = time.perf_counter()
        for path in glob.glob(folder + "/*.json"):
            try:
                entry = json.load(open(path))[0]
                url = "http://" + entry["targets"][0] + entry["labels"]["__metrics_path__"]
                t0 = time.perf_counter()
                urllib.request.urlopen(url, timeout=5).read()
                took += time.perf_counter() - t0
                done += 1
            except (OSError, ValueError, KeyError):
                pass  # the run is starting or ending
        time.sleep(max(0.0, every - (time.perf_counter() - start)))
except KeyboardInterrupt:
    print(json.dumps({"scrapes": done, "scrape_s": took}), flush=True)
"""


@contextlib.contextmanager
def scraped(every_s: float) -> Iterator[tuple[str, dict[str, float]]]:
    """A targets folder for the run, scraped every `every_s` seconds while the block runs;
    the dict gets the number of scrapes and their total time."""
    got: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen([sys.executable, "-c", SCRAPER, folder, str(every_s)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            yield folder, got
        finally:
            proc.send_signal(2)  # SIGINT: print the counts and stop
            out, _ = proc.communicate(timeout=30)
            got.update(json.loads(out or "{}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--out", default=str(RESULTS / "metrics_overhead.json"))
    a = ap.parse_args()
    base = [
        f"model.name={a.model}", "data.source=digits", f"data.batch_size={a.batch}",
        f"train.max_steps={a.steps}", "train.eval_every=0", "train.checkpoint_every=0",
        f"train.log_every={a.log_every}", "train.device=cpu",
    ]
    on_args = [*base, "observe.metrics_port=0", "observe.metrics_address=127.0.0.1"]
    off: list[float] = []
    on: list[float] = []
    scrapes: list[dict[str, float]] = []

    def run_on() -> None:
        with scraped(a.scrape_s) as (folder, got):
            on.append(hpcml_throughput([*on_args, f"observe.targets_dir={folder}"], a.warmup))
        scrapes.append(got)

    load_before = os.getloadavg()[0]
    for i in range(a.pairs):
        # ABBA order: a drift of the machine's speed over the run does not favour either side.
        if i % 2 == 0:
            off.append(hpcml_throughput(base, a.warmup))
            run_on()
        else:
            run_on()
            off.append(hpcml_throughput(base, a.warmup))
        print(f"pair {i + 1}/{a.pairs}: off {off[-1]:.0f}  on {on[-1]:.0f} samples/s, "
              f"{scrapes[-1].get('scrapes', 0):.0f} scrapes", flush=True)  # fmt: skip
    ratios = [b / x for x, b in zip(off, on, strict=True)]
    result = {
        "benchmark": "metrics_overhead",
        "command": " ".join(["python", "benchmarks/metrics_overhead.py", *sys.argv[1:]]),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "settings": vars(a),
        "off_samples_per_s": off,
        "on_samples_per_s": on,
        "pair_ratios_on_over_off": ratios,
        "median_ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "median_off": statistics.median(off),
        "median_on": statistics.median(on),
        "scrapes_per_on_run": [g.get("scrapes", 0) for g in scrapes],
        "mean_scrape_ms": 1e3 * sum(g.get("scrape_s", 0) for g in scrapes)
        / max(1.0, sum(g.get("scrapes", 0) for g in scrapes)),
    }
    # An upper bound on the exporter's share of a scraped run's time: a scrape's whole round
    # trip (client included) over the interval between scrapes. The training process cannot
    # lose more than the time its exporter thread spent answering, which the round trip holds.
    result["scrape_wall_share"] = result["mean_scrape_ms"] / (1e3 * a.scrape_s)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"on/off: median {result['median_ratio']:.3f} "
        f"(pairs {result['ratio_min']:.3f} .. {result['ratio_max']:.3f}); "
        f"{sum(result['scrapes_per_on_run']):.0f} scrapes, {result['mean_scrape_ms']:.1f} ms each "
        f"({100 * result['scrape_wall_share']:.2f}% of the time between scrapes); "
        f"wrote {a.out}"
    )


if __name__ == "__main__":
    main()
