"""`hpcml serve --tracing`: a trace per request from a real server on loopback, REST and gRPC,
collected by OpenTelemetry's SDK in memory.

Eight REST requests sent at once share batches (the batcher waits up to 200 ms to fill one):
each trace must hold receive, queue, compute and respond in that order inside its root span,
and the requests naming one batch must be exactly as many as its size and show one forward
pass, so a span placed from the wrong timing or the wrong batch fails. A gRPC request
and a malformed one (400, error status, no compute) complete the picture.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.observe.tracing import system_id_generator
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"hidden": 16, "depth": 1}
CHILDREN = ["receive", "queue", "compute", "respond"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Any]]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(
        tmp_path_factory.mktemp("run") / "export", model, "mlp", ARGS, (3, 32, 32), (10,)
    )
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=system_id_generator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = ServeConfig.model_validate(
        {"grpc_port": 0, "defaults": {"max_batch_size": 8, "max_queue_delay_ms": 200}}
    )
    app = build_app(export, cfg, name="digits", tracer=provider.get_tracer("test"))
    with running_server(app) as url:
        yield url, app.state.grpc_port, exporter


def _body(seed: int) -> dict[str, Any]:
    x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
    return {
        "id": f"r{seed}",
        "inputs": [
            {
                "name": "input",
                "shape": [1, 3, 32, 32],
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
        ],
    }


async def _burst(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        replies = await asyncio.gather(
            *(client.post("/v2/models/digits/infer", json=_body(i)) for i in range(n))
        )
    return [r.status_code for r in replies]


def _traces(exporter: InMemorySpanExporter) -> dict[int, dict[str, Any]]:
    """The requests' traces (batch spans, traces of their own, left out)."""
    by_trace: dict[int, dict[str, Any]] = defaultdict(dict)
    for span in exporter.get_finished_spans():
        if span.name != "hpcml.batch":
            by_trace[span.context.trace_id][span.name] = span
    return by_trace


def _check_structure(trace: dict[str, Any]) -> None:
    root = trace["hpcml.infer"]
    assert sorted(trace) == sorted(["hpcml.infer", *CHILDREN])
    times = []
    for name in CHILDREN:
        span = trace[name]
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
        times += [span.start_time, span.end_time]
    assert times == sorted(times), "receive, queue, compute, respond overlap or are out of order"
    assert trace["queue"].end_time == trace["compute"].start_time


def test_each_request_is_a_trace_and_batches_show(traced: tuple[str, int, Any]) -> None:
    url, _, exporter = traced
    exporter.clear()
    assert asyncio.run(_burst(url, 8)) == [200] * 8
    traces = _traces(exporter)
    assert len(traces) == 8
    batches: dict[int, list[Any]] = defaultdict(list)
    for trace in traces.values():
        _check_structure(trace)
        root = trace["hpcml.infer"]
        assert dict(root.attributes) == {
            "hpcml.protocol": "http",
            "hpcml.model": "digits",
            "hpcml.version": "1",
            "hpcml.code": "200",
        }
        batches[trace["compute"].attributes["hpcml.batch"]].append(trace["compute"])
    for spans in batches.values():
        # One sample per request: a batch's size is the number of requests that name it, and
        # they show one forward pass (one clock anchor converts all their times).
        assert [s.attributes["hpcml.batch_size"] for s in spans] == [len(spans)] * len(spans)
        assert len({(s.start_time, s.end_time) for s in spans}) == 1
    assert len(batches) < 8, "eight requests sent at once were never batched"
    # One span per batch, linking the root spans of exactly the requests it served.
    roots_of: dict[int, set[int]] = defaultdict(set)
    for trace in traces.values():
        roots_of[trace["compute"].attributes["hpcml.batch"]].add(trace["hpcml.infer"].context.span_id)
    batch_spans = [s for s in exporter.get_finished_spans() if s.name == "hpcml.batch"]
    assert sorted(s.attributes["hpcml.batch"] for s in batch_spans) == sorted(roots_of)
    for span in batch_spans:
        assert {link.context.span_id for link in span.links} == roots_of[span.attributes["hpcml.batch"]]
        compute = batches[span.attributes["hpcml.batch"]][0]
        assert (span.start_time, span.end_time) == (compute.start_time, compute.end_time)


def test_grpc_and_a_malformed_request(traced: tuple[str, int, Any]) -> None:
    url, grpc_port, exporter = traced
    exporter.clear()
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    inp = tgrpc.InferInput("input", [1, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
    client.infer("digits", [inp])
    bad = httpx.post(f"{url}/v2/models/digits/infer", content=b"{not json", timeout=30)
    assert bad.status_code == 400
    traces = list(_traces(exporter).values())
    assert len(traces) == 2
    ok = next(t for t in traces if t["hpcml.infer"].attributes["hpcml.protocol"] == "grpc")
    _check_structure(ok)
    assert ok["hpcml.infer"].attributes["hpcml.code"] == "OK"
    failed = next(t for t in traces if t["hpcml.infer"].attributes["hpcml.protocol"] == "http")
    root = failed["hpcml.infer"]
    assert root.attributes["hpcml.code"] == "400"
    assert root.status.status_code == StatusCode.ERROR
    assert set(failed) == {"hpcml.infer"}, "a request that was never parsed has no children"


def test_a_client_traceparent_continues_its_trace_over_http_and_grpc(
    traced: tuple[str, int, Any],
) -> None:
    """The root span of a request is a SERVER span under the client's span when the request
    carries a W3C traceparent (header or gRPC metadata), not the root of a trace of its own."""
    url, grpc_port, exporter = traced
    exporter.clear()
    # (trace id, parent span id) the client's tracer would have made; fixed, not random.
    http_ids = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    grpc_ids = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    reply = httpx.post(
        f"{url}/v2/models/digits/infer",
        json=_body(0),
        headers={"traceparent": f"00-{http_ids[0]}-{http_ids[1]}-01"},
        timeout=30,
    )
    assert reply.status_code == 200
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    inp = tgrpc.InferInput("input", [1, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
    client.infer("digits", [inp], headers={"traceparent": f"00-{grpc_ids[0]}-{grpc_ids[1]}-01"})
    roots = {
        span.attributes["hpcml.protocol"]: span
        for span in exporter.get_finished_spans()
        if span.name == "hpcml.infer"
    }
    assert sorted(roots) == ["grpc", "http"]
    for protocol, (trace_id, span_id) in (("http", http_ids), ("grpc", grpc_ids)):
        root = roots[protocol]
        assert root.kind == SpanKind.SERVER
        assert root.context.trace_id == int(trace_id, 16), protocol
        assert root.parent is not None and root.parent.is_remote
        assert root.parent.span_id == int(span_id, 16), protocol
    # Its children stay in the client's trace too.
    children = [s for s in exporter.get_finished_spans() if s.name in CHILDREN]
    assert {s.context.trace_id for s in children} == {int(http_ids[0], 16), int(grpc_ids[0], 16)}
