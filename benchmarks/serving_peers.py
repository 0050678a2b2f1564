"""The servers of benchmarks/serving.py: starting and stopping them, and the peers.

Each peer runs as `python serving_peers.py KIND ...`:

  litserve   LitServe with its batching and `fast_queue` where the installed version has it
  fastapi    a plain FastAPI endpoint, one forward pass per request (sync, thread pool)
  ray        Ray Serve with `@serve.batch`, one replica with one CPU, on a local Ray

Each answers POST PATH with an OIP JSON request for one sample and returns OIP JSON; each
answers GET on its health path (see benchmarks/serving.py's `_start`). The model is the
benchmark's hpcml export, loaded with one torch thread. Every peer parses and writes JSON with
orjson, as `hpcml serve` does: FastAPI and Ray read the raw body and answer orjson bytes;
LitServe parses in its API process with starlette's `Request.json`, which this process points
at orjson, and its `encode_response` returns orjson bytes. `describe KIND` prints the peer's
package versions and the options it runs with (recorded in the results); `raw` prints the
model's batched forward rate on one thread, the physical limit a server approaches. This file is the `__main__` of the
peer's process, so LitServe's spawned workers find `BenchAPI` here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
INFER_PATH = "/v2/models/bench/infer"
MAX_BATCH = 32
QUEUE_DELAY_MS = 2.0


def _load_model(export: str) -> Any:
    import torch

    from hpcml.models.export import load_export

    torch.set_num_threads(1)
    model, _ = load_export(Path(export))
    return model


def _response(y: np.ndarray) -> bytes:
    """OIP JSON for one output, written by orjson (numpy natively), as hpcml writes it."""
    import orjson

    out = {
        "model_name": "bench",
        "outputs": [
            {"name": "logits", "shape": list(y.shape), "datatype": "FP32", "data": y.reshape(-1)}
        ],
    }
    return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


def _request_array(body: dict[str, Any]) -> np.ndarray:
    tensor = body["inputs"][0]
    return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])


def _orjson_requests() -> None:
    """Point starlette's `Request.json` (what LitServe's API process parses with) at orjson."""
    import orjson
    from starlette.requests import Request

    async def json(self: Request) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json

    Request.json = json  # type: ignore[method-assign]


def _json_response(body: bytes) -> Any:
    from starlette.responses import Response

    return Response(content=body, media_type="application/json")


try:  # LitServe spawns its workers, which must find the API class at module level.
    import litserve as ls

    _orjson_requests()  # at import: LitServe's API server is a spawned process too

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

        def encode_response(self, output: np.ndarray) -> Any:
            return _json_response(_response(output))

except ImportError:  # pragma: no cover - only the litserve baseline needs it
    ls = None


def _litserve_options() -> dict[str, Any]:
    import inspect

    options: dict[str, Any] = {"accelerator": "cpu", "workers_per_device": 1, "timeout": 60}
    if "fast_queue" in inspect.signature(ls.LitServer.__init__).parameters:
        options["fast_queue"] = True  # an older LitServe has only its default queue
    return options


def serve_litserve(export: str, port: int) -> None:
    api = BenchAPI(
        export, max_batch_size=MAX_BATCH, batch_timeout=QUEUE_DELAY_MS / 1000, api_path=INFER_PATH
    )
    server = ls.LitServer(api, **_litserve_options())
    server.run(
        host="127.0.0.1",
        port=port,
        num_api_servers=1,
        generate_client_file=False,
        log_level="warning",
    )


def serve_ray(export: str, port: int) -> None:
    """Ray Serve with `@serve.batch` (max 32, 2 ms), one replica with one CPU, on a local Ray."""
    import ray
    from ray import serve
    from starlette.requests import Request

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    # max_ongoing_requests above the batch size: Ray's default (5) would cap every batch at 5.
    @serve.deployment(
        num_replicas=1, max_ongoing_requests=4 * MAX_BATCH, ray_actor_options={"num_cpus": 1}
    )
    class RayBench:
        def __init__(self, export: str) -> None:
            self.model = _load_model(export)

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=QUEUE_DELAY_MS / 1000)
        async def predict(self, xs: list[np.ndarray]) -> list[bytes]:
            import torch

            with torch.inference_mode():
                y = self.model(torch.from_numpy(np.concatenate(xs))).numpy()
            return [_response(y[i : i + 1]) for i in range(len(xs))]

        async def __call__(self, request: Request) -> Any:
            import orjson

            if request.method == "GET":  # the benchmark's readiness probe
                return {"ok": True}
            x = _request_array(orjson.loads(await request.body()))
            return _json_response(await self.predict(x))

    serve.run(RayBench.bind(export), route_prefix=INFER_PATH)  # type: ignore[attr-defined]

    def stop(*_: Any) -> None:
        serve.shutdown()
        ray.shutdown()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(3600)


def serve_fastapi(export: str, port: int) -> None:
    import orjson
    import torch
    import uvicorn
    from fastapi import FastAPI, Request
    from starlette.concurrency import run_in_threadpool

    model = _load_model(export)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    def forward(x: np.ndarray) -> bytes:
        with torch.inference_mode():
            return _response(model(torch.from_numpy(x)).numpy())

    # One forward pass per request, in FastAPI's thread pool (as a sync endpoint runs). A plain
    # starlette route: it gets the request itself (FastAPI would resolve the annotation).
    async def infer(request: Request) -> Any:
        x = _request_array(orjson.loads(await request.body()))
        return _json_response(await run_in_threadpool(forward, x))

    app.router.add_route(INFER_PATH, infer, methods=["POST"])

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    from hpcml.serve.protocol.app import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def _env(kind: str, peer_path: str = "") -> dict[str, str]:
    path = str(ROOT / "src")
    if peer_path and not kind.startswith("hpcml"):
        path += os.pathsep + peer_path
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _missing(kind: str, peer_path: str) -> str | None:
    """Why a peer cannot run here (its package is not importable), or None."""
    module = {"litserve": "litserve", "ray": "ray.serve"}.get(kind)
    if module is None:
        return None
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        env=_env(kind, peer_path),
        capture_output=True,
        timeout=300,
    )
    if probe.returncode == 0:
        return None
    package = {"litserve": "litserve", "ray": "ray[serve]"}[kind]
    return f"{module} is not importable (pip install '{package}', or see --peer-path)"


def _start(
    kind: str, export: Path, port: int, log: Path, peer_path: str = ""
) -> tuple[subprocess.Popen[bytes], str]:
    env = _env(kind, peer_path)
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
            str(Path(__file__).with_name("serving_peers.py")),
            kind,
            "--export",
            str(export),
            "--port",
            str(port),
            "--path",
            INFER_PATH,
            "--max-batch",
            str(MAX_BATCH),
            "--delay-ms",
            str(QUEUE_DELAY_MS),
        ]
        health = INFER_PATH if kind == "ray" else "/health"
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


def _stop(proc: subprocess.Popen[bytes], leader_first: bool = False) -> None:
    """SIGTERM the server's process group (or, for Ray, its driver alone first: its raylet
    must outlive `ray.shutdown()`, which stops the actors Ray runs in their own groups)."""
    if proc.poll() is None:
        if leader_first:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except ProcessLookupError:
            return
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


def describe(kind: str) -> dict[str, Any]:
    """The versions a peer runs with and its options (printed by `describe KIND`)."""
    from importlib.metadata import PackageNotFoundError, version

    packages = {
        "litserve": ["litserve", "fastapi", "starlette", "uvicorn", "pyzmq"],
        "fastapi": ["fastapi", "starlette", "uvicorn"],
        "ray": ["ray", "starlette"],
    }[kind] + ["orjson", "uvloop", "httptools", "torch"]
    versions: dict[str, str | None] = {}
    for pkg in packages:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    batching = {"max_batch_size": MAX_BATCH, "queue_delay_ms": QUEUE_DELAY_MS}
    options: dict[str, Any] = {
        "litserve": {**(_litserve_options() if ls else {}), **batching, "num_api_servers": 1},
        "fastapi": {"batching": None, "handler": "async; forward in the thread pool"},
        "ray": {
            **batching,
            "num_replicas": 1,
            "max_ongoing_requests": 4 * MAX_BATCH,
            "replica_cpus": 1,
            "ray_init_cpus": 2,
        },
    }[kind]
    json_lib = "orjson (request body and response)"
    if kind == "litserve":
        json_lib = "orjson (starlette Request.json patched in the API process; response bytes)"
    return {"versions": versions, "options": options, "json": json_lib, "torch_threads": 1}


def raw_forward(export: str, seconds: float = 1.0) -> dict[str, float]:
    """Samples/s of the bare model at the servers' batch size and at 1, one torch thread."""
    import torch

    model = _load_model(export)
    out = {}
    for batch in (MAX_BATCH, 1):
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 3, 32, 32)))
        x = x.float()
        with torch.inference_mode():
            for _ in range(3):  # warm-up
                model(x)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                model(x)
                n += 1
            out[f"batch_{batch}_samples_per_s"] = n * batch / (time.perf_counter() - t0)
    return out


def main() -> None:
    global INFER_PATH, MAX_BATCH, QUEUE_DELAY_MS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["litserve", "fastapi", "ray", "describe", "raw"])
    p.add_argument("--peer", default="", help="describe: which peer.")
    p.add_argument("--export", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--path", default=INFER_PATH)
    p.add_argument("--max-batch", type=int, default=MAX_BATCH)
    p.add_argument("--delay-ms", type=float, default=QUEUE_DELAY_MS)
    args = p.parse_args()
    INFER_PATH, MAX_BATCH, QUEUE_DELAY_MS = args.path, args.max_batch, args.delay_ms
    if args.kind in ("describe", "raw"):
        import json

        result = describe(args.peer) if args.kind == "describe" else raw_forward(args.export)
        print(json.dumps(result))
        return
    serve = {"litserve": serve_litserve, "fastapi": serve_fastapi, "ray": serve_ray}[args.kind]
    serve(args.export, args.port)


if __name__ == "__main__":
    main()
