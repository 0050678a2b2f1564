"""KServe's own Python client (`kserve` package) against a real server on loopback.

`InferenceRESTClient` (v2 protocol; JSON tensors, binary tensors in the body after the JSON
header, binary outputs on request) and `InferenceGRPCClient` (raw_input_contents and typed
`contents`) talk to one `hpcml serve` app under a real uvicorn and grpc server, and their outputs
are compared with the same model run in this process.

kserve 0.21 pins `pandas<3` although its client runs on the pandas 3 this venv has (mlflow
allows it); the Makefile therefore installs it with `--no-deps`, beside the `kserve-client`
extra that carries the modules `import kserve` needs (see pyproject.toml).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import torch

try:
    from kserve import (
        InferenceGRPCClient,
        InferenceRESTClient,
        InferInput,
        InferRequest,
        RESTConfig,
    )
    from kserve.protocol.infer_type import RequestedOutput
except ImportError as exc:  # pragma: no cover - which branch runs depends on the machine
    if os.environ.get("CI") == "true":
        pytest.fail(
            f"kserve is missing in CI ({exc}); `make install` installs it with --no-deps.",
            pytrace=False,
        )
    pytest.skip(
        "kserve not installed (pip install -e '.[kserve-client]' && "
        "pip install --no-deps kserve==0.21.0)",
        allow_module_level=True,
    )

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.app import build_app
from hpcml.serve.config import ServeConfig
from hpcml.serve.testing import running_server

ARGS = {"hidden": 16, "depth": 1}
# float32 sums of 3072 products in a different order than torch's: well inside 1e-5 relative.
TOL = {"rtol": 1e-5, "atol": 1e-6}
HEADER_LENGTH = "inference-header-content-length"


class Served:
    def __init__(self, model: torch.nn.Module, url: str, grpc_port: int) -> None:
        self.model = model
        self.url = url
        self.grpc_address = f"127.0.0.1:{grpc_port}"

    def expected(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.model(torch.from_numpy(x)).numpy()


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


def _x(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 32, 32)).astype(np.float32)


def _input(x: np.ndarray, binary: bool) -> InferInput:
    inp = InferInput(name="input", shape=list(x.shape), datatype="FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


async def _rest_session(served: Served) -> None:
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=60))
    try:
        assert await client.is_server_live(served.url) is True
        assert await client.is_server_ready(served.url) is True
        assert await client.is_model_ready(served.url, "digits") is True
        assert await client.is_model_ready(served.url, "cifar") is False  # 404
        cases = [
            # (binary input, request parameters, requested outputs, binary reply expected)
            (False, None, None, False),
            (True, None, None, False),
            (True, {"binary_data_output": True}, None, True),
            (False, None, [RequestedOutput("logits", {"binary_data": True})], True),
            (
                True,
                {"binary_data_output": True},
                [RequestedOutput("logits", {"binary_data": False})],
                False,
            ),
        ]
        for i, (binary_in, params, outputs, binary_out) in enumerate(cases):
            x = _x(3, seed=i)
            request = InferRequest(
                model_name="digits",
                infer_inputs=[_input(x, binary_in)],
                request_id=f"rest-{i}",
                parameters=params,
                request_outputs=outputs,
            )
            body, json_length = request.to_rest()
            assert isinstance(body, bytes) is binary_in and (json_length is not None) is binary_in
            headers: dict[str, str] = {}
            response = await client.infer(
                served.url, request, model_name="digits", response_headers=headers
            )
            assert response.id == f"rest-{i}" and response.model_name == "digits"
            (out,) = response.outputs
            assert out.name == "logits" and out.shape == [3, 10] and out.datatype == "FP32"
            np.testing.assert_allclose(out.as_numpy(), served.expected(x), **TOL)
            # The binary extension's header is there exactly when an output came back binary.
            assert (HEADER_LENGTH in headers) is binary_out, (i, headers)
        bad = np.zeros((2, 3, 16, 16), np.float32)
        for binary_in in (True, False):
            request = InferRequest(model_name="digits", infer_inputs=[_input(bad, binary_in)])
            with pytest.raises(httpx.HTTPStatusError) as err:
                await client.infer(served.url, request, model_name="digits")
            assert err.value.response.status_code == 400
            assert "has shape [-1, 3, 32, 32]" in str(err.value)
        request = InferRequest(model_name="cifar", infer_inputs=[_input(_x(1, 9), True)])
        with pytest.raises(httpx.HTTPStatusError) as err:
            await client.infer(served.url, request, model_name="cifar")
        assert err.value.response.status_code == 404
    finally:
        await client.close()


def test_kserve_rest_client_json_and_binary(served: Served) -> None:
    asyncio.run(_rest_session(served))


async def _grpc_session(served: Served) -> None:
    client = InferenceGRPCClient(served.grpc_address, timeout=60, retries=0)
    try:
        assert await client.is_server_live() is True
        assert await client.is_server_ready() is True
        assert await client.is_model_ready("digits") is True
        for i, binary in enumerate((True, False)):  # raw_input_contents, then typed contents
            x = _x(4, seed=20 + i)
            request = InferRequest(
                model_name="digits",
                infer_inputs=[_input(x, binary)],
                request_id=f"grpc-{i}",
                model_version="1",
            )
            assert bool(request.to_grpc().raw_input_contents) is binary
            response = await client.infer(request)
            assert response.id == f"grpc-{i}" and response.model_name == "digits"
            (out,) = response.outputs
            assert out.name == "logits" and list(out.shape) == [4, 10]
            np.testing.assert_allclose(out.as_numpy(), served.expected(x), **TOL)
        bad = InferRequest(
            model_name="digits", infer_inputs=[_input(np.zeros((9, 3, 32, 32), np.float32), True)]
        )
        with pytest.raises(grpc.RpcError) as err:
            await client.infer(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "accepts 1 to 8" in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as missing:
            await client.is_model_ready("cifar")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await client.close()


def test_kserve_grpc_client_raw_and_typed_contents(served: Served) -> None:
    asyncio.run(_grpc_session(served))
