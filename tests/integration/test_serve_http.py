"""The Open Inference Protocol over a real uvicorn on loopback: endpoints, answers, errors."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import decode_output, encode_request
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"hidden": 16, "depth": 1}


@pytest.fixture(scope="module")
def model_and_url(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[torch.nn.Module, str]]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(
        tmp_path_factory.mktemp("run") / "export", model, "mlp", ARGS, (3, 32, 32), (10,)
    )
    cfg = ServeConfig.model_validate({"max_body_bytes": 200_000, "defaults": {"max_batch_size": 8}})
    with running_server(build_app(export, cfg, name="digits")) as url:
        yield model, url


def test_health_and_metadata(model_and_url: tuple[torch.nn.Module, str]) -> None:
    _, url = model_and_url
    with httpx.Client(base_url=url) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").json() == {"ready": True}
        server = c.get("/v2").json()
        # Only extensions that exist: binary tensors, Triton's model configuration and
        # statistics yes, model_repository (load/unload) no.
        assert server["name"] == "hpcml"
        assert server["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]
        index = c.post("/v2/repository/index").json()
        assert index == [{"name": "digits", "version": "1", "state": "READY"}]
        meta = c.get("/v2/models/digits").json()
        assert meta["versions"] == ["1"]
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
        assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
        assert c.get("/v2/models/digits/versions/1").json()["versions"] == ["1"]
        assert c.get("/v2/models/digits/ready").json() == {"name": "digits", "ready": True}
        assert c.get("/v2/models/digits/versions/1/ready").status_code == 200
        missing = c.get("/v2/models/cifar")
        assert missing.status_code == 404 and "not served here" in missing.json()["error"]
        assert c.get("/v2/models/digits/versions/7/ready").status_code == 404
        paths = c.get("/openapi.json").json()["paths"]
        assert (
            "/v2/models/{name}/infer" in paths
            and "/v2/models/{name}/versions/{version}/infer" in paths
        )


def test_inference_matches_torch_and_echoes_the_request_id(
    model_and_url: tuple[torch.nn.Module, str],
) -> None:
    model, url = model_and_url
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    with httpx.Client(base_url=url) as c:
        r = c.post("/v2/models/digits/infer", json=encode_request(x, request_id="abc"))
        assert r.status_code == 200
        body = r.json()
        assert (
            body["model_name"] == "digits" and body["model_version"] == "1" and body["id"] == "abc"
        )
        assert body["outputs"][0]["name"] == "logits" and body["outputs"][0]["shape"] == [3, 10]
        with torch.inference_mode():
            expected = model(torch.from_numpy(x)).numpy()
        # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
        np.testing.assert_allclose(decode_output(body), expected, rtol=0, atol=3e-3)
        nested = {
            "inputs": [
                {"name": "input", "shape": [3, 3, 32, 32], "datatype": "FP32", "data": x.tolist()}
            ]
        }
        r2 = c.post("/v2/models/digits/versions/1/infer", json=nested)
        np.testing.assert_allclose(decode_output(r2.json()), expected, rtol=0, atol=3e-3)


@pytest.mark.parametrize(
    ("tensor", "status", "message"),
    [
        ({"name": "image"}, 400, "has input 'input' but the request sent 'image'"),
        ({"shape": [1, 3, 16, 16], "data": [0.0] * 768}, 400, "has shape [-1, 3, 32, 32]"),
        (
            # 2**24 + 1 has no float32: converting it would change the value.
            {"datatype": "INT64", "data": [2**24 + 1] * 3072},
            400,
            "has datatype FP32, but the request sent INT64",
        ),
        ({"shape": [9, 3, 32, 32], "data": [0.0] * 9 * 3072}, 400, "accepts 1 to 8"),
        ({"data": [0.0] * 10}, 400, "needs 3072"),
    ],
)
def test_bad_inputs_are_400_with_a_clear_error(
    model_and_url: tuple[torch.nn.Module, str], tensor: dict, status: int, message: str
) -> None:
    _, url = model_and_url
    req = {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}
    req.update(tensor)
    r = httpx.post(f"{url}/v2/models/digits/infer", json={"inputs": [req]})
    assert r.status_code == status
    assert message in r.json()["error"]


def test_unknown_model_version_body_and_path_errors(
    model_and_url: tuple[torch.nn.Module, str],
) -> None:
    _, url = model_and_url
    ok = encode_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    with httpx.Client(base_url=url) as c:
        assert c.post("/v2/models/cifar/infer", json=ok).status_code == 404
        r = c.post("/v2/models/digits/versions/2/infer", json=ok)
        assert r.status_code == 404 and "no version '2'" in r.json()["error"]
        r = c.post(
            "/v2/models/digits/infer",
            content=b"{oops",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
        big = {
            "inputs": [
                {
                    "name": "input",
                    "shape": [8, 3, 32, 32],
                    "datatype": "FP32",
                    "data": [0.123456] * 8 * 3072,
                }
            ]
        }
        r = c.post("/v2/models/digits/infer", json=big)
        assert r.status_code == 413 and "limit of 200000 bytes" in r.json()["error"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
            payload = json.dumps(big).encode()
            for i in range(0, len(payload), 65536):
                yield payload[i : i + 65536]

        r = c.post(
            "/v2/models/digits/infer",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413
        r = c.get("/v3/whatever")
        assert r.status_code == 404 and "error" in r.json()
        assert c.get("/v2/health/live").status_code == 200


def test_metrics_count_requests_by_model_version_protocol_and_code(
    model_and_url: tuple[torch.nn.Module, str],
) -> None:
    _, url = model_and_url
    with httpx.Client(base_url=url) as c:
        ok = encode_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
        c.post("/v2/models/digits/infer", json=ok)
        c.post("/v2/models/nope/infer", json=ok)
        text = c.get("/metrics").text
    assert 'hpcml_requests_total{code="200",model="digits",protocol="http",version="1"}' in text
    assert 'hpcml_requests_total{code="404",model="",protocol="http",version=""}' in text
    assert 'model="nope"' not in text  # unknown names do not create series
    assert 'hpcml_model_ready{model="digits",version="1"} 1.0' in text
    assert 'hpcml_worker_restarts_total{model="digits",version="1"} 0.0' in text
    for name in (
        "hpcml_request_duration_seconds_bucket",
        "hpcml_request_queue_seconds_bucket",
        "hpcml_batch_compute_seconds_bucket",
        "hpcml_batch_size_bucket",
        "hpcml_queue_depth",
    ):
        assert re.search(rf'^{name}\{{.*model="digits"', text, re.M), name


@pytest.mark.parametrize(
    ("headers", "content", "message"),
    [
        ({"content-type": "text/plain"}, None, "content type 'text/plain' is not accepted"),
        ({"content-type": "application/x-www-form-urlencoded"}, None, "is not accepted"),
        ({"content-encoding": "gzip"}, None, "content encoding 'gzip' is not supported"),
        ({"inference-header-content-length": "-1"}, None, "must be a non-negative integer"),
        ({"inference-header-content-length": "99999"}, None, "must give the length"),
        ({}, b"\xff\xfe{", "not valid JSON"),
        (
            {},
            b'{"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", '
            b'"data": [NaN]}]}',
            "not valid JSON",
        ),
    ],
)
def test_bad_headers_and_bodies_are_400_in_the_protocols_error_form(
    model_and_url: tuple[torch.nn.Module, str],
    headers: dict[str, str],
    content: bytes | None,
    message: str,
) -> None:
    _, url = model_and_url
    body = content or json.dumps(encode_request(np.zeros((1, 3, 32, 32), np.float32))).encode()
    r = httpx.post(f"{url}/v2/models/digits/infer", content=body, headers=headers)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert message in r.json()["error"]


def test_admin_endpoints_are_off_without_a_configured_token(
    model_and_url: tuple[torch.nn.Module, str],
) -> None:
    _, url = model_and_url
    r = httpx.post(
        f"{url}/admin/models/digits/rollback", headers={"Authorization": "Bearer anything"}
    )
    assert r.status_code == 403 and "disabled" in r.json()["error"]
