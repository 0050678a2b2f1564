"""The OTLP export itself: `hpcml train --nproc 2` with `observe.tracing` and `hpcml serve
--tracing` send their spans by OTLP/HTTP (OpenTelemetry's own exporter, configured by hpcml)
to $OTEL_EXPORTER_OTLP_ENDPOINT on loopback, where a receiver decodes them with the OTLP
protobuf definitions (opentelemetry-proto's ExportTraceServiceRequest), as a collector would.

It fails if hpcml builds no exporter, loses the resource labels (service, run, rank: checked
by dropping the rank from the training resource), repeats trace ids across ranks, or breaks
the parent links of the span trees."""

from __future__ import annotations

import gzip
import http.server
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

# The observe extra's exporter: missing fails (an import error), never skips.
import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
import pytest
import torch
from fault_util import env, finish, wait_for, write_config
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model

pytestmark = pytest.mark.slow


class Receiver:
    """An OTLP/HTTP trace endpoint on loopback: every span it is sent, with its resource."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                outer.take(self.path, body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, path: str, body: bytes) -> None:
        assert path == "/v1/traces", path
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append(
                            {
                                "name": s.name,
                                "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "resource": resource,
                                "scope": ss.scope.name,
                            }
                        )

    def named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def otlp_env(receiver: Receiver) -> dict[str, str]:
    # The generic endpoint variable: the exporter appends /v1/traces. A short batch delay so
    # spans leave while the server still runs.
    return env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_BSP_SCHEDULE_DELAY="200")


def test_training_ranks_export_their_step_spans_by_otlp(tmp_path: Path, receiver: Receiver) -> None:
    config = write_config(
        tmp_path / "c.yaml",
        train={"max_steps": 4, "checkpoint_every": 0, "log_every": 2},
        observe={"tracing": True},
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcml",
            "train",
            str(config),
            "--run-dir",
            str(tmp_path / "run"),
            "--quiet",
            "--nproc",
            "2",
        ],
        env=otlp_env(receiver),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Sent before each process ended (the trainer flushes its tracer, and the SDK's exit hook
    # would too): nothing to wait for.
    steps = receiver.named("hpcml.step")
    by_rank: dict[int, list[int]] = {}
    for s in steps:
        assert s["resource"]["service.name"] == "hpcml-train"
        assert s["resource"]["hpcml.run"] == "run"
        assert s["resource"]["hpcml.rank"] == s["attributes"]["hpcml.rank"]
        by_rank.setdefault(s["attributes"]["hpcml.rank"], []).append(s["attributes"]["hpcml.step"])
    assert {r: sorted(v) for r, v in by_rank.items()} == {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}
    # Every step is its own trace, on both ranks: no id repeats across the two processes.
    assert len({s["trace"] for s in steps}) == 8
    ids = {s["id"]: s for s in steps}
    forwards = receiver.named("hpcml.forward")
    assert len(forwards) == 8
    for f in forwards:
        parent = ids[f["parent"]]  # inside its step, in the step's trace
        assert parent["trace"] == f["trace"]
        assert parent["resource"]["hpcml.rank"] == f["resource"]["hpcml.rank"]


def test_a_server_exports_a_trace_per_request_by_otlp(tmp_path: Path, receiver: Receiver) -> None:
    torch.manual_seed(0)
    args = {"hidden": 16, "depth": 1}
    export = save_export(
        tmp_path / "export", build_model("mlp", args), "mlp", args, (3, 32, 32), (10,)
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcml",
            "serve",
            str(export),
            "--name",
            "m",
            "--port",
            str(port),
            "--tracing",
        ],
        env=otlp_env(receiver),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        x = torch.randn(3 * 32 * 32, generator=torch.Generator().manual_seed(0)).tolist()
        body = {
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": x}]
        }
        wait_for("the server answers", lambda: _ok(url, body), timeout=120, every=0.3, proc=server)
        for _ in range(2):
            assert _ok(url, body)
        roots = wait_for(
            "three request traces at the receiver",
            lambda: len(r := receiver.named("hpcml.infer")) >= 3 and r,
            timeout=30,
            every=0.2,
        )
        assert len({r["trace"] for r in roots}) == len(roots)
        for root in roots:
            assert root["resource"]["service.name"] == "hpcml-serve"
            assert root["attributes"]["hpcml.model"] == "m"
            wait_for(
                "the request's four phases",
                lambda root=root: (
                    _children(receiver, root) == ["compute", "queue", "receive", "respond"]
                ),
                timeout=30,
                every=0.2,
            )
    finally:
        server.send_signal(signal.SIGTERM)
        finish(server, 60)


def _ok(url: str, body: dict[str, Any]) -> bool:
    try:
        return httpx.post(f"{url}/v2/models/m/infer", json=body, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _children(receiver: Receiver, root: dict[str, Any]) -> list[str]:
    with receiver.lock:
        return sorted(
            s["name"]
            for s in receiver.spans
            if s["parent"] == root["id"] and s["trace"] == root["trace"]
        )
