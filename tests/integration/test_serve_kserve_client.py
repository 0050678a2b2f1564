"""KServe's own Python client (`kserve` package) against a real server on loopback.

`InferenceRESTClient` (v2 protocol; JSON tensors, binary tensors in the body after the JSON
header, binary outputs on request) and `InferenceGRPCClient` (raw_input_contents and typed
`contents`) talk to one `hpcml serve` app under a real uvicorn and grpc server, and their outputs
are compared with the same model run in this process.

The clients run in a child process (this file run as a script): kserve's and tritonclient's
gRPC stubs both register `inference.*` messages in protobuf's process-wide descriptor pool, so
one process cannot import both ("duplicate symbol"), and pytest imports every test module of
the suite into each worker. The child gets the inputs and the expected outputs (computed here,
by the model in this process) in an .npz and checks every answer against them.

kserve 0.21 pins `pandas<3` although its client runs on the pandas 3 this venv has (mlflow
allows it); the Makefile therefore installs it with `--no-deps`, beside the `kserve-client`
extra that carries the modules `import kserve` needs (see pyproject.toml).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

# float32 sums of 3072 products in a different order than torch's: well inside 1e-5 relative.
TOL = {"rtol": 1e-5, "atol": 1e-6}
HEADER_LENGTH = "inference-header-content-length"
REST_CASES = [
    # (binary input, request parameters, requested output binary_data, binary reply expected)
    (False, None, None, False),
    (True, None, None, False),
    (True, {"binary_data_output": True}, None, True),
    (False, None, True, True),
    (True, {"binary_data_output": True}, False, False),
]
GRPC_CASES = [True, False]  # raw_input_contents, then typed contents


def _x(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 32, 32)).astype(np.float32)


# ------------------------------------------------------------------ the child: kserve's clients


def _input(x: np.ndarray, binary: bool) -> Any:
    from kserve import InferInput

    inp = InferInput(name="input", shape=list(x.shape), datatype="FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


async def _rest_session(url: str, data: Any) -> None:
    import httpx
    from kserve import InferenceRESTClient, InferRequest, RESTConfig
    from kserve.protocol.infer_type import RequestedOutput

    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=60))
    try:
        assert await client.is_server_live(url) is True
        assert await client.is_server_ready(url) is True
        assert await client.is_model_ready(url, "digits") is True
        assert await client.is_model_ready(url, "cifar") is False  # 404
        for i, (binary_in, params, out_binary, binary_out) in enumerate(REST_CASES):
            x = data[f"rest_x{i}"]
            outputs = None
            if out_binary is not None:
                outputs = [RequestedOutput("logits", {"binary_data": out_binary})]
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
                url, request, model_name="digits", response_headers=headers
            )
            assert response.id == f"rest-{i}" and response.model_name == "digits"
            (out,) = response.outputs
            assert out.name == "logits" and out.shape == [3, 10] and out.datatype == "FP32"
            np.testing.assert_allclose(out.as_numpy(), data[f"rest_y{i}"], **TOL)
            # The binary extension's header is there exactly when an output came back binary.
            assert (HEADER_LENGTH in headers) is binary_out, (i, headers)
        bad = np.zeros((2, 3, 16, 16), np.float32)
        for binary_in in (True, False):
            request = InferRequest(model_name="digits", infer_inputs=[_input(bad, binary_in)])
            try:
                await client.infer(url, request, model_name="digits")
                raise AssertionError("a 16x16 input was accepted")
            except httpx.HTTPStatusError as err:
                assert err.response.status_code == 400, err
                assert "has shape [-1, 3, 32, 32]" in str(err), err
        request = InferRequest(model_name="cifar", infer_inputs=[_input(data["rest_x0"], True)])
        try:
            await client.infer(url, request, model_name="cifar")
            raise AssertionError("an unknown model answered")
        except httpx.HTTPStatusError as err:
            assert err.response.status_code == 404, err
    finally:
        await client.close()


async def _grpc_session(address: str, data: Any) -> None:
    import grpc
    from kserve import InferenceGRPCClient, InferRequest

    client = InferenceGRPCClient(address, timeout=60, retries=0)
    try:
        assert await client.is_server_live() is True
        assert await client.is_server_ready() is True
        assert await client.is_model_ready("digits") is True
        for i, binary in enumerate(GRPC_CASES):
            x = data[f"grpc_x{i}"]
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
            np.testing.assert_allclose(out.as_numpy(), data[f"grpc_y{i}"], **TOL)
        too_many = np.zeros((9, 3, 32, 32), np.float32)
        bad = InferRequest(model_name="digits", infer_inputs=[_input(too_many, True)])
        try:
            await client.infer(bad)
            raise AssertionError("a batch of 9 was accepted (max 8)")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "accepts 1 to 8" in (err.details() or ""), err
        try:
            await client.is_model_ready("cifar")
            raise AssertionError("an unknown model is ready")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err
    finally:
        await client.close()


def _child(which: str, target: str, npz: str) -> None:
    with np.load(npz, allow_pickle=False) as data:
        arrays = dict(data)
    session = _rest_session if which == "rest" else _grpc_session
    asyncio.run(session(target, arrays))
    print(f"kserve {which} client: all checks passed")


if __name__ == "__main__":
    _child(*sys.argv[1:4])
    sys.exit(0)


# ------------------------------------------------------------------ the parent: server, model

import pytest  # noqa: E402 - the child above needs neither pytest nor torch
import torch  # noqa: E402

from hpcml.models.export import save_export  # noqa: E402
from hpcml.models.zoo import build_model  # noqa: E402
from hpcml.serve.config import ServeConfig  # noqa: E402
from hpcml.serve.protocol.app import build_app  # noqa: E402
from hpcml.serve.testing import running_server  # noqa: E402

ARGS = {"hidden": 16, "depth": 1}

if importlib.util.find_spec("kserve") is None:  # pragma: no cover - depends on the machine
    if os.environ.get("CI") == "true":
        pytest.fail(
            "kserve is missing in CI; `make install` installs it with --no-deps.", pytrace=False
        )
    pytest.skip(
        "kserve not installed (pip install -e '.[kserve-client]' && "
        "pip install --no-deps kserve==0.21.0)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(REST URL, gRPC address, .npz of the inputs and the in-process model's outputs)."""
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    folder = tmp_path_factory.mktemp("run")
    export = save_export(folder / "export", model, "mlp", ARGS, (3, 32, 32), (10,))
    arrays = {}
    for prefix, count, batch, seed in (("rest", len(REST_CASES), 3, 0), ("grpc", 2, 4, 20)):
        for i in range(count):
            x = _x(batch, seed + i)
            arrays[f"{prefix}_x{i}"] = x
            with torch.inference_mode():
                arrays[f"{prefix}_y{i}"] = model(torch.from_numpy(x)).numpy()
    npz = folder / "cases.npz"
    np.savez(npz, **arrays)
    cfg = ServeConfig.model_validate({"grpc_port": 0, "defaults": {"max_batch_size": 8}})
    app = build_app(export, cfg, name="digits")
    with running_server(app) as url:
        yield url, f"127.0.0.1:{app.state.grpc_port}", npz


def _run_child(which: str, target: str, npz: Path) -> None:
    proc = subprocess.run(
        [sys.executable, __file__, which, target, str(npz)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"kserve {which} client: all checks passed" in proc.stdout


def test_kserve_rest_client_json_and_binary(served: tuple[str, str, Path]) -> None:
    url, _, npz = served
    _run_child("rest", url, npz)


def test_kserve_grpc_client_raw_and_typed_contents(served: tuple[str, str, Path]) -> None:
    _, address, npz = served
    _run_child("grpc", address, npz)
