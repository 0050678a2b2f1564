"""Dynamic batching, backpressure and timeouts over a real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

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


def _repository(root: Path, names: list[str]) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    for name in names:
        save_export(root / name / "1", model, "mlp", ARGS, (3, 32, 32), (10,))
    return root, model


def _metric(text: str, name: str, model: str) -> float:
    pattern = rf'^{re.escape(name)}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$'
    values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
    return sum(values)


def _bucket(text: str, model: str, le: str) -> float:
    m = re.search(
        rf'^hpcml_batch_size_bucket\{{le="{le}",model="{model}",version="1"\}} (\S+)$', text, re.M
    )
    assert m, f"no batch-size bucket le={le} for {model}"
    return float(m.group(1))


CONFIG = {
    "models": {
        # A long delay makes the batch wait until 16 samples are queued: one forward pass.
        "batched": {"max_batch_size": 16, "max_queue_delay_ms": 5000},
        # 8 samples of queue; a 7-sample request waits a second for its batch to fill.
        "tight": {
            "max_batch_size": 8,
            "max_queue_size": 8,
            "max_queue_delay_ms": 1000,
            "isolation": "thread",
        },
        "slow": {
            "max_batch_size": 8,
            "max_queue_delay_ms": 5000,
            "timeout_ms": 100,
            "isolation": "thread",
        },
    }
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, torch.nn.Module]]:
    repo, model = _repository(tmp_path_factory.mktemp("repo"), list(CONFIG["models"]))
    with running_server(build_app(repo, ServeConfig.model_validate(CONFIG))) as url:
        yield url, model


def test_many_clients_are_merged_into_batches_and_split_back(
    served: tuple[str, torch.nn.Module],
) -> None:
    url, model = served
    xs = np.random.default_rng(0).standard_normal((16, 1, 3, 32, 32)).astype(np.float32)

    async def main() -> list[np.ndarray]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            rs = await asyncio.gather(
                *(c.post("/v2/models/batched/infer", json=encode_request(x)) for x in xs)
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [decode_output(r.json()) for r in rs]

    outputs = asyncio.run(main())
    with torch.inference_mode():
        expected = model(torch.from_numpy(xs[:, 0])).numpy()
    for i, out in enumerate(outputs):
        # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
        np.testing.assert_allclose(out[0], expected[i], rtol=0, atol=3e-3)
    text = httpx.get(f"{url}/metrics").text
    forward_passes = _metric(text, "hpcml_batch_size_count", "batched")
    assert _metric(text, "hpcml_batch_size_sum", "batched") == 16
    assert forward_passes == 1
    assert _bucket(text, "batched", "1.0") == 0 and _bucket(text, "batched", "16.0") == 1


def test_full_queue_answers_503_at_once_and_the_server_stays_healthy(
    served: tuple[str, torch.nn.Module],
) -> None:
    url, _ = served
    seven = encode_request(np.zeros((7, 3, 32, 32), dtype=np.float32))
    two = encode_request(np.zeros((2, 3, 32, 32), dtype=np.float32))

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            waiting = asyncio.create_task(c.post("/v2/models/tight/infer", json=seven))
            while _metric((await c.get("/metrics")).text, "hpcml_queue_depth", "tight") < 7:
                await asyncio.sleep(0.01)
            refused = await asyncio.gather(
                *(c.post("/v2/models/tight/infer", json=two) for _ in range(12))
            )
            # Refusals came back while the queued request was still waiting for its batch.
            assert not waiting.done()
            assert [r.status_code for r in refused] == [503] * 12
            assert "overloaded" in refused[0].json()["error"]
            depth = _metric((await c.get("/metrics")).text, "hpcml_queue_depth", "tight")
            assert depth == 7  # refused requests never entered the queue
            assert (await c.get("/v2/health/live")).status_code == 200
            assert (await c.get("/v2/health/ready")).status_code == 200
            assert (await waiting).status_code == 200
            after = await c.post("/v2/models/tight/infer", json=two)
            assert after.status_code == 200

    asyncio.run(main())


def test_request_that_waits_past_its_timeout_gets_504_and_leaves_the_queue(
    served: tuple[str, torch.nn.Module],
) -> None:
    url, _ = served
    r = httpx.post(
        f"{url}/v2/models/slow/infer",
        json=encode_request(np.zeros((1, 3, 32, 32), dtype=np.float32)),
        timeout=30,
    )
    assert r.status_code == 504 and "timed out after 100 ms" in r.json()["error"]
    text = httpx.get(f"{url}/metrics").text
    assert _metric(text, "hpcml_queue_depth", "slow") == 0
    assert _metric(text, "hpcml_batch_size_count", "slow") == 0  # it was never computed
    assert 'hpcml_requests_total{code="504",model="slow",protocol="http",version="1"} 1.0' in text


def test_overload_status_429_carries_retry_after(tmp_path: Path) -> None:
    repo, _ = _repository(tmp_path / "repo", ["tight"])
    cfg = ServeConfig.model_validate(
        {"overload_status": 429, "retry_after_s": 2, "models": {"tight": CONFIG["models"]["tight"]}}
    )
    seven = encode_request(np.zeros((7, 3, 32, 32), dtype=np.float32))
    two = encode_request(np.zeros((2, 3, 32, 32), dtype=np.float32))
    with running_server(build_app(repo, cfg)) as url:

        async def main() -> httpx.Response:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                waiting = asyncio.create_task(c.post("/v2/models/tight/infer", json=seven))
                while _metric((await c.get("/metrics")).text, "hpcml_queue_depth", "tight") < 7:
                    await asyncio.sleep(0.01)
                refused = await c.post("/v2/models/tight/infer", json=two)
                await waiting
                return refused

        refused = asyncio.run(main())
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2"
