"""The load generator sends binary-tensor requests (benchmarks/serving.py's binary rows).

The benchmark builds both request bodies with tritonclient and hands them, with their headers,
to `run_loadtest`; here those exact payloads go to a real server on loopback.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.config import ServeConfig
from hpcml.serve.loadtest import run_loadtest
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ROOT = Path(__file__).resolve().parents[2]
ARGS = {"hidden": 16, "depth": 1}
# float32 sums of 3072 products in a different order than torch's: well inside 1e-5 relative.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _benchmark() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks/serving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, torch.nn.Module]]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(
        tmp_path_factory.mktemp("run") / "export", model, "mlp", ARGS, (3, 32, 32), (10,)
    )
    cfg = ServeConfig.model_validate({"defaults": {"max_batch_size": 8}})
    with running_server(build_app(export, cfg, name="digits")) as url:
        yield url, model


def _load(url: str, body: bytes, headers: dict[str, str] | None) -> Any:
    return asyncio.run(
        run_loadtest(
            base_url=url,
            model="digits",
            concurrency=2,
            duration_s=0.5,
            payload=body,
            headers=headers,
        )
    )


def test_benchmark_binary_and_json_payloads_through_the_load_generator(
    served: tuple[str, torch.nn.Module],
) -> None:
    url, model = served
    payloads = _benchmark()._payloads()
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    with torch.inference_mode():
        expected = model(torch.from_numpy(x)).numpy()
    assert len(payloads["binary"][0]) < len(payloads["json"][0]) / 4  # 12 KiB of raw floats
    for encoding, (body, headers) in payloads.items():
        reply = httpx.post(f"{url}/v2/models/digits/infer", content=body, headers=headers)
        assert reply.status_code == 200, reply.text
        length = reply.headers.get("inference-header-content-length")
        assert (length is not None) is (encoding == "binary")  # the output came back binary
        if length is not None:
            got = np.frombuffer(reply.content[int(length) :], "<f4").reshape(1, 10)
        else:
            got = np.asarray(reply.json()["outputs"][0]["data"], np.float32).reshape(1, 10)
        np.testing.assert_allclose(got, expected, **TOL)
        result = _load(url, body, headers)
        assert result.sent > 0 and result.ok == result.sent and not result.errors, encoding
    # Without the extension's header the binary body is not JSON: every request is a 400.
    result = _load(url, payloads["binary"][0], None)
    assert result.sent > 0 and result.ok == 0 and result.errors == {"400": result.sent}
