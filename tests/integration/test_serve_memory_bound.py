"""Memory bounded by the request: tiny bodies that claim huge shapes, against a real server.

`hpcml serve` runs in its own process under an address-space limit (RLIMIT_AS, set before
exec, so a runaway allocation fails there instead of taking this machine's memory). Requests
of about a hundred bytes claim shapes across the dangerous range (1e4 .. 2^31-1 elements) for
every datatype, as JSON, as binary tensor data, and over gRPC (raw and typed contents). Every
answer must be a 4xx (gRPC: INVALID_ARGUMENT or RESOURCE_EXHAUSTED) and the server's peak
resident memory must not grow by more than a small bound: a decoder that allocates what the
shape claims before checking the bytes present (main's BYTES decoder did: `np.empty(count)`)
grows it by gigabytes or fails with a 500 under the limit.
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
import torch

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.loadtest import wait_ready
from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
from hpcml.serve.oip_pb import grpc_predict_v2_pb2_grpc as pb_grpc
from hpcml.serve.protocol.app import bind_socket

pytestmark = pytest.mark.timeout(300)

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = {"hidden": 8, "depth": 1, "input_shape": [2, 2]}
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES"]  # fmt: skip
# Element counts from 1e4 to 2^31-1 (the most a shape may claim), about 4x apart.
COUNTS = [10_000, 50_000, 2**18, 2**20, 2**22, 2**24, 2**26, 2**27, 2**29, 2**31 - 1]
# The server's virtual address space: torch and gRPC reserve a few GiB of mappings they never
# touch; 8 GiB leaves room for them while a 2^31-element object array (16 GiB) cannot fit.
ADDRESS_SPACE_BYTES = 8 * 2**30
# Peak RSS growth allowed over the whole barrage: allocator arenas and first-use caches of the
# paths exercised (measured: 0.5 MiB); one 2^24-element BYTES array alone is 128 MiB.
RSS_GROWTH_BYTES = 64 * 2**20


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def _tiny_data(datatype: str) -> tuple[list[object], bytes]:
    """One element of `datatype`, as JSON data and as raw bytes."""
    if datatype == "BYTES":
        return ["a"], struct.pack("<I", 1) + b"a"
    if datatype == "BOOL":
        return [True], b"\x01"
    fmt = {"UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b", "INT16": "h",
           "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f", "FP64": "d"}[datatype]  # fmt: skip
    return [1], struct.pack("<" + fmt, 1)


def _http_cases() -> list[tuple[str, bytes, dict[str, str]]]:
    cases = []
    for datatype in DATATYPES:
        data, raw = _tiny_data(datatype)
        for count in COUNTS:
            tensor = {"name": "input", "shape": [count], "datatype": datatype}
            body = orjson.dumps({"inputs": [{**tensor, "data": data}]})
            cases.append((f"json {datatype} [{count}]", body, {"content-type": "application/json"}))
            header = orjson.dumps(
                {"inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}]}
            )
            headers = {
                "content-type": "application/octet-stream",
                "inference-header-content-length": str(len(header)),
            }
            cases.append((f"binary {datatype} [{count}]", header + raw, headers))
    return cases


def _grpc_cases() -> list[tuple[str, pb.ModelInferRequest]]:
    contents_field = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                      "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                      "UINT16": "uint_contents", "UINT32": "uint_contents",
                      "UINT64": "uint64_contents", "FP32": "fp32_contents",
                      "FP64": "fp64_contents", "BYTES": "bytes_contents"}  # fmt: skip
    cases = []
    for datatype in DATATYPES:
        data, raw = _tiny_data(datatype)
        for count in COUNTS:
            tensor = pb.ModelInferRequest.InferInputTensor(
                name="input", datatype=datatype, shape=[count]
            )
            msg = pb.ModelInferRequest(model_name="digits", inputs=[tensor])
            msg.raw_input_contents.append(raw)
            cases.append((f"grpc raw {datatype} [{count}]", msg))
            if datatype in contents_field:
                typed = pb.ModelInferRequest(model_name="digits")
                t = typed.inputs.add(name="input", datatype=datatype, shape=[count])
                value = data[0].encode() if datatype == "BYTES" else data[0]
                getattr(t.contents, contents_field[datatype]).append(value)
                cases.append((f"grpc contents {datatype} [{count}]", typed))
    return cases


def test_tiny_requests_claiming_huge_shapes_get_4xx_and_do_not_grow_memory(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    export = save_export(
        tmp_path / "export", build_model("mlp", ARGS).eval(), "mlp", ARGS, (2, 2), (10,)
    )
    port, grpc_port = _free_port(), _free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"grpc_port: {grpc_port}\ndefaults: {{isolation: thread, max_batch_size: 8}}\n"
    )
    # Two malloc arenas: each thread's own 64 MiB arena reservation would otherwise count
    # against the address-space limit.
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcml", "serve", str(export), "--name", "digits",
         "--port", str(port), "--config", str(config)],  # fmt: skip
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "server.err").open("w"),
        preexec_fn=_limit_address_space,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=180)
        http_cases, grpc_cases = _http_cases(), _grpc_cases()
        with (
            httpx.Client(base_url=url, timeout=60) as client,
            grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # Warm-up: one valid-shaped refusal of each path, so first-use allocations (gRPC
            # buffers, thread pools) are in the baseline rather than in the growth.
            for _, body, headers in http_cases[:2]:
                client.post("/v2/models/digits/infer", content=body, headers=headers)
            with pytest.raises(grpc.RpcError):
                stub.ModelInfer(grpc_cases[0][1], timeout=60)
            before = _peak_rss_bytes(proc.pid)
            bad: list[str] = []
            for label, body, headers in http_cases:
                r = client.post("/v2/models/digits/infer", content=body, headers=headers)
                if not (400 <= r.status_code < 500 and "error" in r.json()):
                    bad.append(f"{label}: {r.status_code} {r.text[:120]}")
            for label, msg in grpc_cases:
                try:
                    stub.ModelInfer(msg, timeout=60)
                    bad.append(f"{label}: answered OK")
                except grpc.RpcError as exc:
                    code = exc.code()
                    if code not in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                    ):
                        bad.append(f"{label}: {code} {exc.details()[:120]}")
            growth = _peak_rss_bytes(proc.pid) - before
        print(f"\n{len(http_cases) + len(grpc_cases)} requests; peak RSS growth {growth} bytes")
        assert not bad, "\n".join(bad[:20])
        assert growth < RSS_GROWTH_BYTES, growth
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print((tmp_path / "server.err").read_text()[-3000:])
