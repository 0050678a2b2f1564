"""Server limits over a real uvicorn on loopback: requests in flight, and their exemptions."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import encode_request_bytes
from hpcml.serve.config import ServeConfig
from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
from hpcml.serve.oip_pb import grpc_predict_v2_pb2_grpc as pb_grpc
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"hidden": 8, "depth": 1, "input_shape": [2, 2]}


def test_requests_past_the_concurrency_limit_get_503_at_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(tmp_path / "export", model, "mlp", ARGS, (2, 2), (10,))
    cfg = ServeConfig.model_validate(
        {
            "limit_concurrency": 2,
            "retry_after_s": 3,
            "max_body_bytes": 4096,
            "defaults": {"isolation": "thread"},
        }
    )
    payload = encode_request_bytes(np.zeros((1, 2, 2), np.float32))

    async def main(url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        head = (
            f"POST /v2/models/digits/infer HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        # Two requests held in flight over raw sockets: headers and 5 bytes of body sent, the
        # rest withheld, so the server is waiting for their bodies.
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + payload[:5])
            await writer.drain()
            held.append((reader, writer))
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            refused = None
            for _ in range(600):  # until both held requests have reached the app
                r = await c.post("/v2/models/digits/infer", content=payload)
                if r.status_code == 503:
                    refused = r
                    break
                await asyncio.sleep(0.05)
            assert refused is not None, "the third concurrent request was never refused"
            assert refused.headers["retry-after"] == "3"
            assert "limit of 2 concurrent requests" in refused.json()["error"]
            # Probes and scrapes are exempt: a saturated replica is not a dead one.
            assert (await c.get("/v2/health/ready")).status_code == 200
            metrics = (await c.get("/metrics")).text
            # Refused before any route ran, yet counted (main counted neither kind): the
            # limiter's 503s, and a 413 from a Content-Length over the limit.
            assert re.search(
                r'^hpcml_requests_total\{code="503",model="digits",protocol="http",version=""\} '
                r"[1-9]",
                metrics,
                re.M,
            ), metrics
            for reader, writer in held:
                writer.write(payload[5:])
                await writer.drain()
                status_line = await reader.readline()
                assert status_line.startswith(b"HTTP/1.1 200"), status_line
                writer.close()
            # Once they finish, requests are let in again.
            assert (await c.post("/v2/models/digits/infer", content=payload)).status_code == 200
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"POST /v2/models/digits/versions/1/infer HTTP/1.1\r\nhost: {host}\r\n"
                "content-length: 5000\r\n\r\n".encode()  # over max_body_bytes: not read
            )
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 413")
            writer.close()
            metrics = (await c.get("/metrics")).text
            assert re.search(
                r'^hpcml_requests_total\{code="413",model="digits",protocol="http",version="1"\} '
                r"1\.0$",
                metrics,
                re.M,
            ), metrics

    with running_server(build_app(export, cfg, name="digits")) as url:
        asyncio.run(main(url))


def test_slow_bodies_get_408_and_model_readiness_is_exempt_from_the_limit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(tmp_path / "export", model, "mlp", ARGS, (2, 2), (10,))
    # 5 s for a body: the test sees the saturation (a few local requests, milliseconds)
    # long before the held bodies run out of time, even on a heavily shared CPU.
    cfg = ServeConfig.model_validate(
        {"limit_concurrency": 2, "body_timeout_s": 5, "defaults": {"isolation": "thread"}}
    )
    payload = encode_request_bytes(np.zeros((1, 2, 2), np.float32))

    async def main(url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        head = (
            f"POST /v2/models/digits/infer HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        # Two slow clients: headers and 5 bytes of body, then nothing. On main they held the
        # server's two slots for as long as they liked.
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + payload[:5])
            await writer.drain()
            held.append((reader, writer))
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for _ in range(600):  # until both held requests have reached the app
                r = await c.post("/v2/models/digits/infer", content=payload)
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.01)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            # Saturated, yet every probe tells the truth (main: 503 from the model's).
            for probe in ("/v2/models/digits/ready", "/v2/models/digits/versions/1/ready"):
                assert (await c.get(probe)).status_code == 200, probe
            for reader, writer in held:
                status_line = await asyncio.wait_for(reader.readline(), 60)
                assert status_line.startswith(b"HTTP/1.1 408"), status_line
                rest = await asyncio.wait_for(reader.read(4096), 60)
                assert b"did not arrive within 5 s (body_timeout_s)" in rest, rest
                writer.close()
            # Their slots are free again.
            assert (await c.post("/v2/models/digits/infer", content=payload)).status_code == 200

    with running_server(build_app(export, cfg, name="digits")) as url:
        asyncio.run(main(url))


def test_grpc_limit_covers_inference_only_and_pushes_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(tmp_path / "export", model, "mlp", ARGS, (2, 2), (10,))
    # One request in flight at a time; a lone request waits 5 s in the queue for company, so
    # it holds the only slot while the test looks (milliseconds of local calls).
    cfg = ServeConfig.model_validate(
        {
            "grpc_port": 0,
            "limit_concurrency": 1,
            "retry_after_s": 2,
            "defaults": {"isolation": "thread", "max_queue_delay_ms": 5000},
        }
    )
    msg = pb.ModelInferRequest(model_name="digits")
    msg.inputs.add(name="input", datatype="FP32", shape=[1, 2, 2])
    msg.raw_input_contents.append(bytes(16))
    app = build_app(export, cfg, name="digits")
    with (
        running_server(app) as url,
        grpc.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel,
    ):
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        first = infer.future(msg, timeout=60)
        for _ in range(600):  # until it waits in the queue
            if (
                'hpcml_queue_depth{model="digits",version="1"} 1.0'
                in httpx.get(url + "/metrics").text
            ):
                break
        with pytest.raises(grpc.RpcError) as refused:
            infer(msg, timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("grpc-retry-pushback-ms", "2000") in refused.value.trailing_metadata()
        # Probes are not inference: they answer while the slot is taken (main: refused too).
        health = health_pb2_grpc.HealthStub(channel)
        check = health.Check(health_pb2.HealthCheckRequest(service="digits"), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        ready = pb_grpc.GRPCInferenceServiceStub(channel).ModelReady(
            pb.ModelReadyRequest(name="digits"), timeout=30
        )
        assert ready.ready and not first.done()
        assert first.result().model_name == "digits"


def test_slow_headers_get_the_connection_closed(tmp_path: Path) -> None:
    # uvicorn bounds no header read: on main a client sending half a request line kept its
    # connection for as long as it liked.
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(tmp_path / "export", model, "mlp", ARGS, (2, 2), (10,))
    cfg = ServeConfig.model_validate({"header_timeout_s": 1, "defaults": {"isolation": "thread"}})

    async def main(url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        silent = await asyncio.open_connection(host, int(port))  # sends nothing at all
        slow = await asyncio.open_connection(host, int(port))
        slow[1].write(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n")  # never ends its headers
        await slow[1].drain()
        for reader, writer in (silent, slow):
            # Closed by the server: end of stream, no response (60 s: only if it never closes).
            assert await asyncio.wait_for(reader.read(), 60) == b""
            writer.close()
        # A prompt client on a kept-alive connection is unaffected.
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for _ in range(3):
                assert (await c.get("/v2/health/live")).status_code == 200
                await asyncio.sleep(0.6)  # 3 x 0.6 s > 1 s: the timer must not span requests

    with running_server(build_app(export, cfg, name="digits")) as url:
        asyncio.run(main(url))
