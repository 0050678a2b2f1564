"""Where the CPU of a batched request goes, beside the raw batched forward (issue 31's 0.5 goal).

`hpcml serve` with dynamic batching (the benchmark's MLP, max 32, 2 ms) is driven closed-loop
by `hpcml loadtest` in this process over loopback, JSON and binary alternately; for each step
the CPU time per request of the server's event-loop thread, of its inference process and of the
load generator, and the mean batch the batcher formed (from Triton's statistics endpoint). The
model's forward alone is timed beside it on one torch thread with the thread's CPU clock at
batch sizes 32, 16, 8 and 1. CPU times, unlike rates, barely move with other work on a shared
machine; they say what each request costs, not what a quiet machine would sustain.

    python benchmarks/serving_budget.py [--concurrency 32] [--repeats 3] [--tag TAG]

Writes benchmarks/results/serving_budget[_TAG].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, thread: int | None = None) -> float:
    path = f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _batches(base: str) -> dict[int, int]:
    with urllib.request.urlopen(base + "/v2/models/bench/stats") as resp:
        stats = json.load(resp)["model_stats"][0]["batch_stats"]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats}


def _forward_cpu_ms(export: Path) -> dict[str, float]:
    import serving_peers
    import torch

    torch.set_num_threads(1)
    model = serving_peers._load_model(str(export))
    out = {}
    for batch in (32, 16, 8, 1):
        x = torch.randn(batch, 3, 32, 32)
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            n, t0 = 0, time.thread_time()
            while time.thread_time() - t0 < 1.0:
                model(x)
                n += 1
        out[f"batch_{batch}"] = (time.thread_time() - t0) / (n * batch) * 1e3
    return out


def _measure(args: argparse.Namespace, export: Path, payloads: dict[str, Any]) -> dict[str, Any]:
    import serving
    from serving_peers import _free_port, _start, _stop, _wait

    port = _free_port()
    proc, health = _start("hpcml-batched", export, port, export.parent / "server.log")
    base = f"http://127.0.0.1:{port}"
    steps: dict[str, list[dict[str, float]]] = {"json": [], "binary": []}
    try:
        _wait(base + health, proc)
        child = _children(proc.pid)
        for _ in range(args.repeats):
            for encoding in steps:
                serving._step(base, payloads[encoding], None, 4, 0.5)  # warm-up
                b0, c0 = _batches(base), time.process_time()
                loop0, kid0 = _cpu_s(proc.pid, proc.pid), sum(_cpu_s(k) for k in child)
                st = serving._step(base, payloads[encoding], None, args.concurrency, args.step_s)
                loop1, kid1 = _cpu_s(proc.pid, proc.pid), sum(_cpu_s(k) for k in child)
                c1, b1 = time.process_time(), _batches(base)
                n = st["ok"]
                done = {s: b1.get(s, 0) - b0.get(s, 0) for s in b1}
                steps[encoding].append(
                    {
                        "throughput": st["throughput"],
                        "event_loop_ms": (loop1 - loop0) / n * 1e3,
                        "inference_process_ms": (kid1 - kid0) / n * 1e3,
                        "load_generator_ms": (c1 - c0) / n * 1e3,
                        "mean_batch": sum(s * k for s, k in done.items()) / sum(done.values()),
                    }
                )
    finally:
        _stop(proc)
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-s", type=float, default=3.0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(HERE))
    import serving

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        export, _ = serving._make_export(Path(tmp))
        forward = _forward_cpu_ms(export)
        steps = _measure(args, export, serving._payloads())
    summary = {
        enc: {k: statistics.median(st[k] for st in rows) for k in rows[0]}
        for enc, rows in steps.items()
    }
    report = {
        "benchmark": "serving_budget",
        "unit": "CPU milliseconds per request (forward: per sample, one torch thread)",
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },  # fmt: skip
        "forward_cpu_ms_per_sample": forward,
        "summary": summary,
        "steps": steps,
    }
    lines = [
        f"CPU ms per request at closed-loop concurrency {args.concurrency}, median of "
        f"{args.repeats}; load average {load_before[0]:.1f} before, "
        f"{report['machine']['loadavg_after'][0]:.1f} after ({os.cpu_count()} CPUs).",
        "",
        "| encoding | event loop | inference process | load generator | mean batch |",
        "|---|---:|---:|---:|---:|",
    ]
    for enc, s in summary.items():
        lines.append(
            f"| {enc} | {s['event_loop_ms']:.3f} | {s['inference_process_ms']:.3f} | "
            f"{s['load_generator_ms']:.3f} | {s['mean_batch']:.1f} |"
        )
    lines += ["", "Forward alone, CPU ms per sample: "
              + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in forward.items())]  # fmt: skip
    text = "\n".join(lines) + "\n"
    stem = "serving_budget" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
