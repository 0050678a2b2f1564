"""Stock Open Inference Protocol clients against a real server on loopback, REST and gRPC.

tritonclient's HTTP client (binary tensors by default, and JSON), its gRPC client
(raw_input_contents), and the gRPC stub generated from KServe's proto (typed `contents`) all
talk to one `hpcml serve` app, whose /metrics scrape must then pass `promtool check metrics`.
"""

from __future__ import annotations

import csv
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tests.conftest import system_binary
from tritonclient.utils import InferenceServerException

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.config import ServeConfig
from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
from hpcml.serve.oip_pb import grpc_predict_v2_pb2_grpc as pb_grpc
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"hidden": 16, "depth": 1}
# float32 sums of 3072 products in a different order than torch's: well inside 1e-5 relative.
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Served:
    def __init__(self, model: torch.nn.Module, url: str, grpc_port: int) -> None:
        self.model = model
        self.url = url
        self.http_address = url.removeprefix("http://")
        self.grpc_address = f"127.0.0.1:{grpc_port}"

    def expected(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.model(torch.from_numpy(np.asarray(x, dtype=np.float32))).numpy()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(
        tmp_path_factory.mktemp("run") / "export", model, "mlp", ARGS, (3, 32, 32), (10,)
    )
    cfg = ServeConfig.model_validate({"grpc_port": 0, "defaults": {"max_batch_size": 8}})
    app = build_app(export, cfg, name="digits")
    with running_server(app) as url:
        yield Served(model, url, app.state.grpc_port)


def _x(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 32, 32)).astype(np.float32)


def test_tritonclient_http_binary_and_json(served: Served) -> None:
    client = thttp.InferenceServerClient(served.http_address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits")
    meta = client.get_model_metadata("digits")
    assert meta["inputs"][0]["shape"] == [-1, 3, 32, 32]
    x = _x(3)
    expected = served.expected(x)
    for binary_in in (True, False):
        inp = thttp.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary_in)
        # No outputs named: tritonclient asks for binary outputs (binary_data_output).
        result = client.infer("digits", [inp], request_id=f"r-{binary_in}")
        np.testing.assert_allclose(result.as_numpy("logits"), expected, **TOL)
        assert result.get_response()["id"] == f"r-{binary_in}"
        assert "parameters" in result.get_output("logits")  # it came back binary
        for binary_out in (True, False):
            out = thttp.InferRequestedOutput("logits", binary_data=binary_out)
            result = client.infer("digits", [inp], outputs=[out], model_version="1")
            np.testing.assert_allclose(result.as_numpy("logits"), expected, **TOL)
            assert ("data" in result.get_output("logits")) is not binary_out
    assert client.get_model_repository_index() == [
        {"name": "digits", "version": "1", "state": "READY"}
    ]
    client.close()


@pytest.mark.parametrize(
    ("datatype", "array"),
    [
        ("FP16", _x(2, 1).astype(np.float16)),
        ("FP64", _x(2, 2).astype(np.float64)),
        ("INT8", np.random.default_rng(3).integers(-128, 128, (2, 3, 32, 32), dtype=np.int8)),
        ("UINT8", np.random.default_rng(4).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)),
        ("INT64", np.random.default_rng(5).integers(-(2**24), 2**24, (2, 3, 32, 32))),
        ("BOOL", np.random.default_rng(6).integers(0, 2, (2, 3, 32, 32)).astype(bool)),
    ],
)
def test_other_datatypes_are_converted_for_a_fp32_model_on_both_protocols(
    served: Served, datatype: str, array: np.ndarray
) -> None:
    # Each of these is held exactly by float32 (FP64 is rounded, as the model would).
    expected = served.expected(array.astype(np.float32))
    http = thttp.InferenceServerClient(served.http_address)
    inp = thttp.InferInput("input", list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    np.testing.assert_allclose(http.infer("digits", [inp]).as_numpy("logits"), expected, **TOL)
    if datatype != "FP16":  # JSON has no half floats on the client side either
        inp.set_data_from_numpy(array, binary_data=False)
        got = http.infer("digits", [inp]).as_numpy("logits")
        np.testing.assert_allclose(got, expected, **TOL)
    g = tgrpc.InferenceServerClient(served.grpc_address)
    ginp = tgrpc.InferInput("input", list(array.shape), datatype)
    ginp.set_data_from_numpy(array)
    np.testing.assert_allclose(g.infer("digits", [ginp]).as_numpy("logits"), expected, **TOL)
    http.close()
    g.close()


@pytest.mark.parametrize(
    ("datatype", "array", "message"),
    [
        ("INT32", np.full((1, 3, 32, 32), 2**24 + 1, np.int32), "cannot all be represented"),
        ("BYTES", np.full((1, 3, 32, 32), b"1", dtype=object), "request sent BYTES"),
        ("FP32", np.zeros((1, 3, 16, 16), np.float32), "has shape [-1, 3, 32, 32]"),
        ("FP32", np.zeros((9, 3, 32, 32), np.float32), "accepts 1 to 8"),
    ],
)
def test_values_the_model_cannot_take_are_400_and_invalid_argument(
    served: Served, datatype: str, array: np.ndarray, message: str
) -> None:
    http = thttp.InferenceServerClient(served.http_address)
    inp = thttp.InferInput("input", list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    with pytest.raises(InferenceServerException) as err:
        http.infer("digits", [inp])
    assert err.value.status() == "400" and message in err.value.message()
    g = tgrpc.InferenceServerClient(served.grpc_address)
    ginp = tgrpc.InferInput("input", list(array.shape), datatype)
    ginp.set_data_from_numpy(array)
    with pytest.raises(InferenceServerException) as gerr:
        g.infer("digits", [ginp])
    assert gerr.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in gerr.value.message()
    http.close()
    g.close()


def test_tritonclient_grpc_metadata_and_errors(served: Served) -> None:
    g = tgrpc.InferenceServerClient(served.grpc_address)
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("digits")
    assert g.is_model_ready("digits", "1")
    assert list(g.get_server_metadata().extensions) == [
        "binary_tensor_data",
        "model_configuration",
        "statistics",
    ]
    meta = g.get_model_metadata("digits")
    assert meta.versions == ["1"] and meta.platform == "pytorch_torch"
    assert list(meta.inputs[0].shape) == [-1, 3, 32, 32] and meta.outputs[0].name == "logits"
    x = _x(4)
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = g.infer("digits", [inp], request_id="g-1", model_version="1")
    np.testing.assert_allclose(result.as_numpy("logits"), served.expected(x), **TOL)
    assert result.get_response().id == "g-1" and result.get_response().model_version == "1"
    for call, code in (
        (lambda: g.infer("cifar", [inp]), "NOT_FOUND"),
        (lambda: g.infer("digits", [inp], model_version="7"), "NOT_FOUND"),
        (lambda: g.get_model_metadata("cifar"), "NOT_FOUND"),
        (lambda: g.is_model_ready("cifar"), "NOT_FOUND"),
    ):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == f"StatusCode.{code}"
    g.close()


def _stub_infer(served: Served, request: Any) -> Any:
    with grpc.insecure_channel(served.grpc_address) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)


def test_typed_contents_and_malformed_grpc_requests(served: Served) -> None:
    x = _x(2, 7)
    tensor = pb.ModelInferRequest.InferInputTensor
    typed = pb.ModelInferRequest(
        model_name="digits",
        inputs=[
            tensor(
                name="input",
                datatype="FP32",
                shape=list(x.shape),
                contents=pb.InferTensorContents(fp32_contents=x.reshape(-1).tolist()),
            )
        ],
    )
    response = _stub_infer(served, typed)
    out = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)
    np.testing.assert_allclose(out, served.expected(x), **TOL)
    raw = x.astype("<f4").tobytes()
    bad = [
        (pb.ModelInferRequest(model_name="digits"), "has no inputs"),
        (
            pb.ModelInferRequest(
                model_name="digits",
                inputs=[tensor(name="input", datatype="FP32", shape=[2, 3, 32, 32])],
                raw_input_contents=[raw[:-4]],
            ),
            "needs 24576",
        ),
        (
            pb.ModelInferRequest(
                model_name="digits",
                inputs=[tensor(name="input", datatype="FP32", shape=[2, 3, 32, 32])],
                raw_input_contents=[raw, raw],
            ),
            "2 entries for 1 inputs",
        ),
        (
            pb.ModelInferRequest(
                model_name="digits",
                inputs=[tensor(name="input", datatype="FP32", shape=[-2, 3, 32, 32])],
                raw_input_contents=[raw],
            ),
            "'shape'",
        ),
        (
            pb.ModelInferRequest(
                model_name="digits",
                inputs=[tensor(name="input", datatype="FP16", shape=[2, 3, 32, 32])],
            ),
            "must be sent in raw_input_contents",
        ),
        (
            pb.ModelInferRequest(
                model_name="digits",
                inputs=[
                    tensor(
                        name="input",
                        datatype="INT8",
                        shape=[1, 1],
                        contents=pb.InferTensorContents(int_contents=[300]),
                    )
                ],
            ),
            "outside the range of INT8",
        ),
    ]
    for request, message in bad:
        with pytest.raises(grpc.RpcError) as err:
            _stub_infer(served, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in err.value.details()


def test_metrics_pass_promtool_and_count_both_protocols(served: Served) -> None:
    promtool = system_binary("promtool", installer=".ci/install_prometheus.sh")
    x = _x(1)
    g = tgrpc.InferenceServerClient(served.grpc_address)
    ginp = tgrpc.InferInput("input", list(x.shape), "FP32")
    ginp.set_data_from_numpy(x)
    g.infer("digits", [ginp])
    with pytest.raises(InferenceServerException):
        g.infer(
            "digits",
            [
                tgrpc.InferInput("input", [1, 2], "FP32").set_data_from_numpy(
                    np.zeros((1, 2), np.float32)
                )
            ],
        )
    g.close()
    with httpx.Client(base_url=served.url) as c:
        c.post("/v2/models/digits/infer", content=b"{")
        text = c.get("/metrics").text
    assert 'hpcml_requests_total{code="OK",model="digits",protocol="grpc",version="1"}' in text
    assert 'code="INVALID_ARGUMENT",model="digits",protocol="grpc"' in text
    assert 'hpcml_requests_total{code="400",model="digits",protocol="http",version=""}' in text
    assert 'hpcml_model_ready{model="digits",version="1"} 1.0' in text
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    # promtool exits 0 and prints nothing when every metric follows the conventions.
    assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr


def test_a_malformed_protobuf_is_invalid_argument_and_counted(served: Served) -> None:
    # Bytes that are no ModelInferRequest (a field tag with a varint that never ends): grpcio
    # alone answered UNKNOWN/INTERNAL with a Python class name, and nothing counted it.
    def counted() -> float:
        text = httpx.get(f"{served.url}/metrics").text
        found = re.search(
            r'^hpcml_requests_total\{code="INVALID_ARGUMENT",model="",protocol="grpc",version=""\}'
            r" (\S+)$",
            text,
            re.M,
        )
        return float(found.group(1)) if found else 0.0

    before = counted()
    with grpc.insecure_channel(served.grpc_address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "not a valid protobuf message" in err.value.details()
    assert counted() == before + 1


def test_tritonclient_model_config_and_statistics(served: Served) -> None:
    client = thttp.InferenceServerClient(served.http_address)
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 8 and config["name"] == "digits"
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [3, 32, 32]}]
    assert config["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]
    assert client.get_model_config("digits", "1") == config
    with pytest.raises(InferenceServerException, match="no version"):
        client.get_model_config("digits", "9")

    def stats() -> dict[str, Any]:
        (entry,) = client.get_inference_statistics("digits")["model_stats"]
        return entry

    before = stats()
    inp = thttp.InferInput("input", [3, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(_x(3))
    for _ in range(2):
        client.infer("digits", [inp])
    one = thttp.InferInput("input", [1, 3, 32, 32], "FP32")
    one.set_data_from_numpy(_x(1))
    client.infer("digits", [one])
    wrong = thttp.InferInput("input", [1, 3, 32, 31], "FP32")  # not the model's shape
    wrong.set_data_from_numpy(np.zeros((1, 3, 32, 31), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("digits", [wrong])
    after = stats()
    failed = after["inference_stats"]["fail"]["count"]
    assert failed == before["inference_stats"]["fail"]["count"] + 1
    ok = after["inference_stats"]["success"]
    assert ok["count"] == before["inference_stats"]["success"]["count"] + 3
    assert after["inference_count"] == before["inference_count"] + 7  # samples: 3 + 3 + 1
    assert ok["ns"] > before["inference_stats"]["success"]["ns"]
    # Each batch is counted once, under its size: their total is the execution count.
    batches = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert sum(batches.values()) == after["execution_count"] >= before["execution_count"] + 2
    assert after["name"] == "digits" and after["version"] == "1"
    assert client.get_inference_statistics()["model_stats"] == [stats()]
    with pytest.raises(InferenceServerException):
        client.get_inference_statistics("nope")
    client.close()


def test_tritonclient_grpc_model_config_statistics_and_repository_index(served: Served) -> None:
    # Unimplemented on main. tritonclient parses the answers with Triton's own full messages.
    client = tgrpc.InferenceServerClient(served.grpc_address)
    config = client.get_model_config("digits", as_json=True)["config"]
    http = thttp.InferenceServerClient(served.http_address)
    rest = http.get_model_config("digits")
    assert config["name"] == rest["name"] == "digits"
    assert int(config["max_batch_size"]) == rest["max_batch_size"] == 8
    assert config["input"] == [
        {"name": "input", "data_type": "TYPE_FP32", "dims": ["3", "32", "32"]}
    ]
    assert config["output"][0]["data_type"] == "TYPE_FP32" and config["output"][0]["dims"] == ["10"]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    with pytest.raises(InferenceServerException, match="no version"):
        client.get_model_config("digits", "9")
    inp = tgrpc.InferInput("input", [2, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(_x(2))
    client.infer("digits", [inp])
    (grpc_stats,) = client.get_inference_statistics("digits", as_json=True)["model_stats"]
    (rest_stats,) = http.get_inference_statistics("digits")["model_stats"]
    # Both read the same counters (no request in between).
    assert int(grpc_stats["inference_count"]) == rest_stats["inference_count"] >= 2
    success = grpc_stats["inference_stats"]["success"]
    assert int(success["count"]) == rest_stats["inference_stats"]["success"]["count"]
    assert client.get_model_repository_index(as_json=True)["models"] == [
        {"name": "digits", "version": "1", "state": "READY"}
    ]
    client.close()
    http.close()


def test_the_load_generator_speaks_grpc(served: Served) -> None:
    from hpcml.serve.loadtest import loadtest

    def grpc_ok() -> float:
        text = httpx.get(f"{served.url}/metrics").text
        found = re.search(
            r'^hpcml_requests_total\{code="OK",model="digits",protocol="grpc",version="1"\} (\S+)$',
            text,
            re.M,
        )
        return float(found.group(1)) if found else 0.0

    before = grpc_ok()
    r = loadtest(
        base_url=served.url,
        model="digits",
        concurrency=2,
        duration_s=0.5,
        binary=True,
        grpc_target=served.grpc_address,
    )
    assert r.ok == r.sent > 0 and r.errors == {}
    assert r.url == f"grpc://{served.grpc_address}/digits"
    assert grpc_ok() == before + r.ok  # every one of them arrived over gRPC


def _requests_total(served: Served, protocol: str) -> float:
    code = "200" if protocol == "http" else "OK"
    found = re.search(
        rf'^hpcml_requests_total\{{code="{code}",model="digits",protocol="{protocol}",'
        rf'version="1"\}} (\S+)$',
        httpx.get(f"{served.url}/metrics").text,
        re.M,
    )
    return float(found.group(1)) if found else 0.0


def _number(label: str, text: str) -> float:
    found = re.search(rf"^ +{label}: ([0-9.]+)", text, re.M)
    assert found is not None, f"no {label!r} line in perf_analyzer's report:\n{text}"
    return float(found.group(1))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_triton_perf_analyzer_measures_the_server_unchanged(
    served: Served, protocol: str, tmp_path: Path
) -> None:
    # Triton's own load generator (C++, tritonclient 2.51.0's binary): it reads the server's
    # metadata and extensions, the model's metadata and configuration, sends binary tensors, and
    # reads the model's statistics before and after it measures (only when the server announces
    # the `statistics` extension, which main did not: its report then had no server side).
    perf_analyzer = system_binary("perf_analyzer", installer=".ci/install_perf_analyzer.sh")
    address = served.http_address if protocol == "http" else served.grpc_address
    command = [perf_analyzer, "-m", "digits", "-u", address, "-i", protocol,
               "--concurrency-range", "2"]  # fmt: skip
    before = _requests_total(served, protocol)
    report = tmp_path / "report.csv"
    sent = 40
    # Zeros, not its default of random bytes: those hold NaN bit patterns (below).
    r = subprocess.run(
        [*command, "--request-count", str(sent), "--input-data", "zero", "-f", str(report)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # The report's two sections: what it measured, and the server's side of it.
    client, server = re.split(r"\n  Server: *\n", r.stdout)
    assert _number("Request count", client) == sent
    # The server's side, from the statistics endpoint: what perf_analyzer counts between its two
    # reads of the model's statistics, each request answered. Its window can miss a request
    # answered at its edge (39 of 40 seen once on a busy 2-core machine, with the server's own
    # count exact); it never holds more than it sent. Every request reaching the server is
    # counted exactly below, by the test's own reads.
    answered = _number("Successful request count", server)
    assert answered == _number("Inference count", server) and 0 < answered <= sent
    assert _requests_total(served, protocol) == before + sent  # and none besides
    (row,) = csv.DictReader(report.open())
    assert row["Concurrency"] == "2"
    assert float(row["Inferences/Second"]) == _number("Throughput", client) > 0
    latencies = [_number(f"p{p} latency", client) for p in (50, 90, 95, 99)]
    assert [float(row[f"p{p} latency"]) for p in (50, 90, 95, 99)] == latencies
    assert 0 < latencies[0] <= latencies[1] <= latencies[2] <= latencies[3]
    if protocol == "http":
        # Its default input, random bytes read as FP32, holds NaN or infinity in nearly every
        # tensor of 3,072 (each value 1/256; none in a tensor: about 6e-6), which the server
        # refuses in binary as JSON cannot carry them; perf_analyzer stops with the sentence.
        refused = subprocess.run(
            [*command, "--request-count", "4"], capture_output=True, text=True, timeout=120
        )
        assert refused.returncode != 0
        assert "holds NaN or infinite FP32 values; send finite numbers" in refused.stderr
