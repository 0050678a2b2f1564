"""Alias-following deploys against a real MLflow SQLite registry and a real `hpcml serve`.

Four clients send requests in a loop while the test moves the `production` alias: first to a
version whose artifact was altered after registration (refused by its sha256, the old version
keeps serving), then to a good version (loaded beside, warmed, switched to, the old one
unloaded). No request may fail, and no request sent after the switch is answered by the old
version. Also: a registered export is an MLflow Model with a tensor signature.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tests.integration.mlflow_util import fresh_store
from tests.integration.test_serve_supervision import _free_port, inference_children
from tests.integration.test_track_registry import make_run

from hpcml.serve.codec.oip import encode_request_bytes
from hpcml.serve.loadtest import wait_ready
from hpcml.track.registry import RegistryError, promote, register_run
from hpcml.track.resolve import resolve_model

pytestmark = pytest.mark.timeout(400)

SRC = Path(__file__).resolve().parents[2] / "src"
NAME = "follow-digits"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    store = fresh_store(tmp_path_factory, "follow")
    root = tmp_path_factory.mktemp("follow-runs")
    for seed in (1, 2, 3):
        make_run(root / f"run{seed}", 0.9, 0.3, seed=seed)
        register_run(root / f"run{seed}", NAME, tracking_uri=store)
    promote(NAME, 1, "production", tracking_uri=store)
    # Version 3's stored weights change after registration (one byte near the end).
    weights = resolve_model(f"models:/{NAME}/3", store).path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    return store, root


def test_export_is_an_mlflow_model_with_a_signature(registry: tuple[str, Path]) -> None:
    from mlflow.models import Model

    store, _ = registry
    model = Model.load(str(resolve_model(f"models:/{NAME}/1", store).path / "MLmodel"))
    assert model.signature is not None
    (inp,) = model.signature.inputs.to_dict()
    (out,) = model.signature.outputs.to_dict()
    assert inp["tensor-spec"] == {"dtype": "float32", "shape": (-1, 1, 8, 8)}
    assert out["tensor-spec"] == {"dtype": "float32", "shape": (-1, 10)}
    assert "hpcml" in model.flavors and "python_function" not in model.flavors


def test_changed_artifact_is_refused(registry: tuple[str, Path], tmp_path: Path) -> None:
    store, _ = registry
    with pytest.raises(RegistryError, match="changed after registration"):
        resolve_model(f"models:/{NAME}/3", store)
    env = {**os.environ, "PYTHONPATH": str(SRC), "MLFLOW_TRACKING_URI": store}
    proc = subprocess.run(
        [sys.executable, "-m", "hpcml", "serve", f"models:/{NAME}/3", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    message = proc.stderr.strip()
    assert "changed after registration" in message and len(message.splitlines()) == 1


def test_follow_moves_to_the_new_version_without_a_failed_request(
    registry: tuple[str, Path], tmp_path: Path
) -> None:
    store, _ = registry
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "MLFLOW_TRACKING_URI": store,
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "server.err"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcml",
            "serve",
            f"models:/{NAME}@production",
            "--follow",
            "--poll-s",
            "0.3",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        cwd=tmp_path,
    )
    try:
        wait_ready(url, timeout_s=180)
        body = encode_request_bytes(np.zeros((1, 1, 8, 8), dtype=np.float32))
        headers = {"content-type": "application/json"}

        async def main() -> tuple[list[tuple[float, float, int, str]], list[str]]:
            answers: list[tuple[float, float, int, str]] = []  # start, end, status, version
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:

                async def client() -> None:
                    while not stop.is_set():
                        t0 = time.monotonic()
                        r = await c.post(f"/v2/models/{NAME}/infer", content=body, headers=headers)
                        version = r.json().get("model_version", "") if r.status_code == 200 else ""
                        answers.append((t0, time.monotonic(), r.status_code, version))

                def served(version: str) -> int:
                    return sum(1 for a in answers if a[3] == version)

                async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
                    deadline = time.monotonic() + 150
                    while not check():
                        assert time.monotonic() < deadline, what
                        await asyncio.sleep(0.02)

                clients = [asyncio.create_task(client()) for _ in range(4)]
                await until(lambda: served("1") >= 30, "version 1 never answered")
                await asyncio.to_thread(promote, NAME, 3, "production", store)
                await until(lambda: "not deploying" in log.read_text(), "v3 was not refused")
                ones = served("1")
                await until(lambda: served("1") >= ones + 30, "v1 stopped answering")
                await asyncio.to_thread(promote, NAME, 2, "production", store)
                await until(lambda: served("2") >= 30, "version 2 never answered")
                await until(lambda: len(inference_children(proc.pid)) == 1, "v1 still loaded")
                stop.set()
                await asyncio.gather(*clients)
                meta = (await c.get(f"/v2/models/{NAME}")).json()
            return answers, meta["versions"]

        answers, versions = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
    statuses = {a[2] for a in answers}
    print(f"\n{len(answers)} requests, statuses {statuses}; log: {log.read_text()[-600:]}")
    assert statuses == {200}, json.dumps(answers[-5:])
    assert {a[3] for a in answers} == {"1", "2"} and versions == ["2"]
    switched_at = min(a[1] for a in answers if a[3] == "2")
    assert all(a[3] == "2" for a in answers if a[0] > switched_at)
    assert "sha256" in log.read_text()  # the refusal of version 3 said why
