"""Event-loop CPU per inference request of `hpcml serve`, side by side with another source tree.

Capacity on a shared machine moves with the load; the CPU time the server's event-loop thread
spends per request barely does, and on a 2-core machine it is what dynamic batching runs out
of (the inference process holds the other core). Each case runs the serve app in its own
process, driven through ASGI with no sockets (uvicorn's HTTP parsing is left out; it is the same
for both trees), with the benchmark's MLP and tritonclient's request bodies (benchmarks/
serving.py): rounds of `--concurrency` requests at once, timed with the thread's CPU clock. The
inference child does the forward pass; its CPU is not counted.

    python benchmarks/serving_cpu.py                          # this tree only
    python benchmarks/serving_cpu.py --baseline-src /tmp/main/src   # and another, interleaved

Cases: JSON and binary bodies with dynamic batching (max 32, 2 ms, 32 requests at once) and
JSON at batch size 1 (one request at a time: mostly the per-batch cost). Each (tree, case) runs
`--repeats` times in alternating order; the table gives the median of the repeats' medians with
their minimum and maximum, and the load average before and after. Writes
benchmarks/results/serving_cpu[_TAG].{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = {  # name: (encoding, max batch size, requests at once)
    "json batched": ("json", 32, 32),
    "binary batched": ("binary", 32, 32),
    "json batch 1": ("json", 1, 1),
}


def _worker(export: str, body_file: str, batch: int, concurrency: int, rounds: int) -> None:
    """Print the main thread's CPU microseconds per request, one number per round (JSON)."""
    import uvloop

    from hpcml.serve.config import ServeConfig
    from hpcml.serve.protocol.app import build_app

    saved = json.loads(Path(body_file).read_text())
    body, extra = bytes.fromhex(saved["body"]), saved["headers"]
    delay = 2.0 if batch > 1 else 0.0
    cfg = ServeConfig.model_validate(
        {"defaults": {"max_batch_size": batch, "max_queue_delay_ms": delay, "threads": 1}}
    )
    app = build_app(export, cfg, name="bench")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    path = "/v2/models/bench/infer"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2)}  # fmt: skip

    async def one() -> None:
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)  # no disconnect while the answer is written
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(dict(scope), receive, send)
        if sent[0]["status"] != 200:
            raise SystemExit(f"the server answered {sent[0]['status']}: {sent[-1].get('body')!r}")

    async def main() -> list[float]:
        per_round = []
        async with app.router.lifespan_context(app):
            for _ in range(5):  # warm-up
                await asyncio.gather(*(one() for _ in range(concurrency)))
            for _ in range(rounds):
                t0 = time.thread_time()
                for _ in range(20):
                    await asyncio.gather(*(one() for _ in range(concurrency)))
                per_round.append((time.thread_time() - t0) / (20 * concurrency) * 1e6)
        return per_round

    print(json.dumps(uvloop.run(main())))


def _bodies(folder: Path) -> dict[str, Path]:
    sys.path.insert(0, str(HERE))
    import serving

    out = {}
    for encoding, (body, headers) in serving._payloads().items():
        out[encoding] = folder / f"{encoding}.json"
        out[encoding].write_text(json.dumps({"body": body.hex(), "headers": headers}))
    return out


def _run(src: Path, export: Path, body: Path, batch: int, conc: int, rounds: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "_worker", str(export), str(body), str(batch), str(conc),
         str(rounds)],
        env={**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the worker for {src} failed:\n{out.stderr[-2000:]}")
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1]))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-src", type=Path, help="Another tree's src/ folder to compare.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="Rounds of 20 x concurrency requests.")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(HERE))
    import serving

    trees = {"this": ROOT / "src"}
    if args.baseline_src is not None:
        trees = {"baseline": args.baseline_src.resolve(), **trees}
    load_before = os.getloadavg()
    results: dict[str, dict[str, list[float]]] = {case: {t: [] for t in trees} for case in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        export, _ = serving._make_export(Path(tmp))
        bodies = _bodies(Path(tmp))
        for rep in range(args.repeats):
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            for case, (encoding, batch, conc) in CASES.items():
                for tree in order:
                    us = _run(trees[tree], export, bodies[encoding], batch, conc, args.rounds)
                    results[case][tree].append(us)
                    print(f"repeat {rep + 1} {case:<15} {tree:<8} {us:8.1f} us/request", flush=True)
    report = {
        "benchmark": "serving_cpu",
        "unit": "event-loop thread CPU microseconds per request (ASGI, no sockets)",
        "cases": {
            c: {"encoding": e, "max_batch_size": b, "concurrency": n}
            for c, (e, b, n) in CASES.items()
        },
        "trees": {t: str(s) for t, s in trees.items()},
        "repeats": args.repeats,
        "rounds": args.rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "summary": {c: {t: _spread(v) for t, v in by.items()} for c, by in results.items()},
        "runs": results,
    }
    lines = [
        f"Event-loop CPU per request (us), median [min .. max] of {args.repeats} repeats; load "
        f"average {load_before[0]:.1f} before, {report['machine']['loadavg_after'][0]:.1f} after "
        f"({os.cpu_count()} CPUs).",
        "",
        "| case | " + " | ".join(trees) + (" | this / baseline |" if len(trees) > 1 else ""),
        "|---|" + "---:|" * (len(trees) + (len(trees) > 1)),
    ]
    for case, by in report["summary"].items():
        cells = [f"{s['median']:.0f} [{s['min']:.0f} .. {s['max']:.0f}]" for s in by.values()]
        if len(trees) > 1:
            cells.append(f"{by['this']['median'] / by['baseline']['median']:.2f}")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    stem = "serving_cpu" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
