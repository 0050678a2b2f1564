"""Serving throughput at equal p99, side by side on one model and one machine.

Four servers answer the same Open Inference Protocol request for the same exported model:

  hpcml-batched   `hpcml serve` with dynamic batching (max 32 samples, 2 ms queue delay)
  hpcml-bs1       `hpcml serve` with max_batch_size 1 (the no-batching baseline)
  litserve        LitServe with its batching (max_batch_size 32, batch_timeout 2 ms)
  fastapi         a plain FastAPI endpoint, one forward pass per request

All four run at the same time, each in its own process with one torch thread per model
instance, and are driven in turns by the open-loop Poisson load generator of `hpcml loadtest`
(latency measured from the intended send time) at rising rates, so background load on the
machine hits each of them alike; each (server, rate) step runs `--repeats` times and the run
with the lower p99 counts, so a burst of someone else's load does not decide it. A server's
capacity at a p99 objective is the highest throughput it sustained without errors and with
p99 within the objective; ratios compare capacities at the same objective.

    python benchmarks/serving.py              # ~6 minutes on 2 cores
    python benchmarks/serving.py --quick      # shorter steps, for a smoke run

Writes benchmarks/results/serving.{json,png,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = {"name": "mlp", "args": {"hidden": 2048, "depth": 3}}
INFER_PATH = "/v2/models/bench/infer"
MAX_BATCH = 32
QUEUE_DELAY_MS = 2.0


# --------------------------------------------------------------------------- baselines


def _load_model(export: str) -> Any:
    import torch

    from hpcml.models.export import load_export

    torch.set_num_threads(1)
    model, _ = load_export(Path(export))
    return model


def _response(y: np.ndarray) -> dict[str, Any]:
    return {
        "model_name": "bench",
        "outputs": [
            {
                "name": "logits",
                "shape": list(y.shape),
                "datatype": "FP32",
                "data": y.reshape(-1).tolist(),
            }
        ],
    }


def _request_array(body: dict[str, Any]) -> np.ndarray:
    tensor = body["inputs"][0]
    return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])


try:  # LitServe spawns its workers, which must find the API class at module level.
    import litserve as ls

    class BenchAPI(ls.LitAPI):
        def __init__(self, export: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.export = export

        def setup(self, device: str) -> None:
            self.model = _load_model(self.export)

        # No annotation: LitServe would turn it into a FastAPI body type and answer 422.
        def decode_request(self, request):  # type: ignore[no-untyped-def]
            return _request_array(request)

        def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(inputs)

        def predict(self, x: np.ndarray) -> np.ndarray:
            import torch

            with torch.inference_mode():
                out: np.ndarray = self.model(torch.from_numpy(x)).numpy()
            return out

        def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
            return [output[i : i + 1] for i in range(len(output))]

        def encode_response(self, output: np.ndarray) -> dict[str, Any]:
            return _response(output)

except ImportError:  # pragma: no cover - only the litserve baseline needs it
    ls = None


def serve_litserve(export: str, port: int) -> None:
    api = BenchAPI(
        export, max_batch_size=MAX_BATCH, batch_timeout=QUEUE_DELAY_MS / 1000, api_path=INFER_PATH
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(
        host="127.0.0.1",
        port=port,
        num_api_servers=1,
        generate_client_file=False,
        log_level="warning",
    )


def serve_fastapi(export: str, port: int) -> None:
    import torch
    import uvicorn
    from fastapi import Body, FastAPI

    model = _load_model(export)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    # A sync endpoint: FastAPI runs it in its thread pool, one forward pass per request.
    @app.post(INFER_PATH)
    def infer(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        x = torch.from_numpy(_request_array(body))
        with torch.inference_mode():
            return _response(model(x).numpy())

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --------------------------------------------------------------------------- driver


def _free_port() -> int:
    from hpcml.serve.app import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def _make_export(folder: Path) -> tuple[Path, int]:
    import torch

    from hpcml.models.export import save_export
    from hpcml.models.zoo import build_model, count_parameters

    torch.manual_seed(0)
    model = build_model(MODEL["name"], MODEL["args"])
    export = save_export(folder / "export", model, MODEL["name"], MODEL["args"], (3, 32, 32), (10,))
    return export, count_parameters(model)


def _start(kind: str, export: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    if kind.startswith("hpcml"):
        batch = str(MAX_BATCH) if kind == "hpcml-batched" else "1"
        delay = str(QUEUE_DELAY_MS) if kind == "hpcml-batched" else "0"
        cmd = [
            sys.executable,
            "-m",
            "hpcml",
            "serve",
            str(export),
            "--name",
            "bench",
            "--port",
            str(port),
            "--max-batch-size",
            batch,
            "--max-queue-delay-ms",
            delay,
            "--threads",
            "1",
            "--json",
        ]
        health = "/v2/health/ready"
    else:
        cmd = [
            sys.executable,
            __file__,
            "--serve",
            kind,
            "--export",
            str(export),
            "--port",
            str(port),
        ]
        health = "/health"
    out = open(log, "wb")  # noqa: SIM115 - closed when the process is stopped
    proc = subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, health


def _wait(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _cpu_s(pgid: int) -> float:
    """CPU seconds used so far by every process of a server's process group (Linux /proc)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields[2] is the process group
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def _step(
    base: str,
    payload: bytes,
    rate: float | None,
    concurrency: int | None,
    seconds: float,
    pgid: int | None = None,
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
            payload=payload,
            infer_path=INFER_PATH,
            timeout_s=30,
        )
    )
    cpu = _cpu_s(pgid) - cpu_before if pgid else None
    return {
        "target_rate": rate,
        "concurrency": concurrency,
        # CPU time is what a saturated, dedicated machine runs out of; unlike latency it
        # barely moves when other work shares the machine.
        "server_cpu_ms_per_request": cpu / r.ok * 1e3 if cpu is not None and r.ok else None,
        "sent": r.sent,
        "ok": r.ok,
        "errors": r.errors,
        "throughput": r.throughput,
        "achieved_rate": r.achieved_rate,
        "latency_ms": r.latency_ms,
        "send_lag_ms_p99": r.send_lag_ms_p99,
    }


def _sustained(step: dict[str, Any], slo_ms: float) -> bool:
    # Open loop: a server that falls behind builds a queue, which shows in p99 at once.
    return not step["errors"] and step["latency_ms"].get("p99", float("inf")) <= slo_ms


def _capacity(steps: list[dict[str, Any]], slo_ms: float) -> dict[str, Any] | None:
    good = [s for s in steps if _sustained(s, slo_ms)]
    return max(good, key=lambda s: s["throughput"]) if good else None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--serve", choices=["litserve", "fastapi"], help=argparse.SUPPRESS)
    p.add_argument("--export", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="One 2 s run per step, for a smoke test.")
    p.add_argument(
        "--repeats", type=int, default=2, help="Runs per (server, rate); the lower p99 counts."
    )
    p.add_argument("--slo-ms", type=float, default=100.0, help="Headline p99 objective (ms).")
    p.add_argument(
        "--slo-list", default="50,100,250,500", help="Also report capacity at these p99s (ms)."
    )
    p.add_argument("--servers", default="hpcml-batched,hpcml-bs1,litserve,fastapi")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.serve == "litserve":
        return serve_litserve(args.export, args.port)
    if args.serve == "fastapi":
        return serve_fastapi(args.export, args.port)

    sys.path.insert(0, str(ROOT / "src"))
    from hpcml.serve.protocol import encode_request_bytes

    step_s = 2.0 if args.quick else 3.0
    repeats = 1 if args.quick else args.repeats
    kinds = args.servers.split(",")
    rates = [20.0 * 1.4**i for i in range(19)]  # 20 .. ~8,500 requests/s
    slos = sorted({args.slo_ms, *(float(x) for x in args.slo_list.split(","))})
    payload = encode_request_bytes(
        np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    )
    tmp = Path(tempfile.mkdtemp(prefix="hpcml-bench-serving-"))
    export, params = _make_export(tmp)
    load_before = os.getloadavg()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    bases: dict[str, str] = {}
    results: dict[str, dict[str, Any]] = {k: {"steps": [], "closed_loop": None} for k in kinds}
    try:
        for kind in kinds:
            port = _free_port()
            proc, health = _start(kind, export, port, tmp / f"{kind}.log")
            procs[kind], bases[kind] = proc, f"http://127.0.0.1:{port}"
            _wait(bases[kind] + health, proc)
            _step(bases[kind], payload, None, 4, 1.0)  # warm-up: connections, allocator, caches
        print(f"{'server':<15} {'target/s':>9} {'ok/s':>9} {'p50 ms':>9} {'p99 ms':>9}  errors")
        failing = {k: 0 for k in kinds}
        for rate in rates:
            active = [k for k in kinds if failing[k] < 2]
            if not active:
                break
            for kind in active:
                # Bursts of load from elsewhere on a shared machine hit single runs; the best
                # of a few runs per step is what the server can do (each server gets as many).
                runs = [
                    _step(bases[kind], payload, rate, None, step_s, procs[kind].pid)
                    for _ in range(repeats)
                ]
                s = min(
                    runs,
                    key=lambda r: (
                        r["latency_ms"].get("p99", float("inf")) + 1e9 * bool(r["errors"])
                    ),
                )
                s["runs_p99_ms"] = [r["latency_ms"].get("p99") for r in runs]
                results[kind]["steps"].append(s)
                # Go on while the loosest SLO holds, so every SLO finds its capacity.
                failing[kind] = 0 if _sustained(s, slos[-1]) else failing[kind] + 1
                lat = s["latency_ms"]
                print(
                    f"{kind:<15} {rate:>9.0f} {s['throughput']:>9.1f} {lat.get('p50', float('nan')):>9.2f} "
                    f"{lat.get('p99', float('nan')):>9.2f}  {s['errors'] or ''}",
                    flush=True,
                )
        for kind in kinds:
            results[kind]["closed_loop"] = _step(
                bases[kind], payload, None, 32, step_s, procs[kind].pid
            )
    finally:
        for proc in procs.values():
            _stop(proc)

    summary = _summarize(results, args.slo_ms)
    summary["by_slo"] = {f"{slo:g}": _summarize(results, slo) for slo in slos}
    for by in summary["by_slo"].values():
        by.pop("closed_loop_32")
    report = {
        "benchmark": "serving",
        "model": {**MODEL, "parameters": params, "input_shape": [3, 32, 32]},
        "slo_p99_ms": args.slo_ms,
        "step_s": step_s,
        "repeats": repeats,
        "batching": {"max_batch_size": MAX_BATCH, "max_queue_delay_ms": QUEUE_DELAY_MS},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "summary": summary,
        "servers": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "serving.md").write_text(_markdown(report))
    _plot(report, args.out / "serving.png")
    print()
    print(_markdown(report))


def _summarize(results: dict[str, dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    cap = {k: _capacity(v["steps"], slo_ms) for k, v in results.items()}
    thr = {k: (c["throughput"] if c else 0.0) for k, c in cap.items()}

    def ratio(a: str, b: str) -> float | None:
        return thr[a] / thr[b] if a in thr and b in thr and thr[b] > 0 else None

    return {
        "capacity_at_slo_rps": thr,
        "p99_at_capacity_ms": {k: (c["latency_ms"]["p99"] if c else None) for k, c in cap.items()},
        "batched_vs_bs1": ratio("hpcml-batched", "hpcml-bs1"),
        "hpcml_vs_litserve": ratio("hpcml-batched", "litserve"),
        "hpcml_vs_fastapi": ratio("hpcml-batched", "fastapi"),
        "server_cpu_ms_per_request": {
            k: float(np.median(cpus))
            if (
                cpus := [
                    st["server_cpu_ms_per_request"]
                    for st in v["steps"]
                    if st.get("server_cpu_ms_per_request") and not st["errors"]
                ]
            )
            else None
            for k, v in results.items()
        },
        "closed_loop_32": {
            k: {
                "throughput": v["closed_loop"]["throughput"],
                "p99_ms": v["closed_loop"]["latency_ms"].get("p99"),
            }
            for k, v in results.items()
            if v["closed_loop"]
        },
    }


def _markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    m = report["model"]
    lines = [
        f"Model `{m['name']}` {m['args']} ({m['parameters'] / 1e6:.1f} M parameters), one sample of "
        f"3x32x32 per request as OIP JSON; {report['machine']['cpus']} CPU cores, one torch thread "
        f"per model instance; open-loop Poisson load, {report['step_s']:g} s per rate step, best "
        f"p99 of {report.get('repeats', 1)} runs.",
        "",
        f"| server | capacity at p99 <= {report['slo_p99_ms']:g} ms (req/s) | p99 there (ms) "
        "| vs hpcml-bs1 | server CPU per request (ms) | closed loop, 32 clients: req/s | p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = s["capacity_at_slo_rps"].get("hpcml-bs1") or 0
    for k, thr in s["capacity_at_slo_rps"].items():
        p99 = s["p99_at_capacity_ms"][k]
        closed = s["closed_loop_32"].get(k, {})
        cpu = s.get("server_cpu_ms_per_request", {}).get(k)
        cells = [
            k,
            f"{thr:,.0f}" if p99 is not None else "not sustained",
            f"{p99:.1f}" if p99 is not None else "-",
            f"{thr / base:.2f}x" if base and p99 is not None else "-",
            f"{cpu:.2f}" if cpu is not None else "-",
            f"{closed.get('throughput', 0):,.0f}",
            f"{closed['p99_ms']:.1f}" if closed.get("p99_ms") is not None else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    fmt = lambda r: f"{r:.2f}x" if r else "n/a"  # noqa: E731
    by = s.get("by_slo", {})
    if by:
        slo_keys = list(by)
        lines += [
            "",
            "Capacity (req/s) by p99 objective:",
            "",
            "| server | " + " | ".join(f"p99 <= {k} ms" for k in slo_keys) + " |",
            "|---|" + "---:|" * len(slo_keys),
        ]
        for k in s["capacity_at_slo_rps"]:
            cells = [f"{by[x]['capacity_at_slo_rps'][k]:,.0f}" for x in slo_keys]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        for label, key in (
            ("batched / bs1", "batched_vs_bs1"),
            ("hpcml / LitServe", "hpcml_vs_litserve"),
            ("hpcml / FastAPI", "hpcml_vs_fastapi"),
        ):
            lines.append(f"| *{label}* | " + " | ".join(fmt(by[x][key]) for x in slo_keys) + " |")
    lines += [
        "",
        f"Dynamic batching vs batch size 1: **{fmt(s['batched_vs_bs1'])}** (goal >= 3x). "
        f"hpcml vs LitServe: **{fmt(s['hpcml_vs_litserve'])}** (goal >= 1.2x). "
        f"hpcml vs plain FastAPI: **{fmt(s['hpcml_vs_fastapi'])}**.",
        "",
    ]
    return "\n".join(lines)


def _plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, data in report["servers"].items():
        steps = [s for s in data["steps"] if s["latency_ms"]]
        x = [s["throughput"] for s in steps]
        ax1.plot(x, [s["latency_ms"]["p99"] for s in steps], marker="o", ms=4, label=kind)
        ax2.plot(x, [s["latency_ms"]["p50"] for s in steps], marker="o", ms=4, label=kind)
    ax1.axhline(
        report["slo_p99_ms"], color="grey", ls="--", lw=1, label=f"SLO {report['slo_p99_ms']:g} ms"
    )
    for ax, what in ((ax1, "p99"), (ax2, "p50")):
        ax.set_yscale("log")
        ax.set_xlabel("throughput (successful requests/s)")
        ax.set_ylabel(f"{what} latency (ms, from intended send time)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = report["model"]
    ax1.set_title(f"{m['name']} {m['parameters'] / 1e6:.1f}M params: p99 vs throughput")
    ax2.set_title("p50 vs throughput")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
