"""`hpcml serve` as a process: graceful shutdown drains in-flight requests; clear CLI errors."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import encode_request_bytes
from hpcml.serve.loadtest import wait_ready
from hpcml.serve.protocol.app import bind_socket

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}
ARGS = {"hidden": 16, "depth": 1}


def _export(path: Path) -> Path:
    torch.manual_seed(0)
    return save_export(path, build_model("mlp", ARGS), "mlp", ARGS, (3, 32, 32), (10,))


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def test_sigterm_finishes_in_flight_requests_then_exits(tmp_path: Path) -> None:
    export = _export(tmp_path / "export")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcml",
            "serve",
            str(export),
            "--name",
            "digits",
            "--port",
            str(port),
            "--max-batch-size",
            "64",
            "--max-queue-delay-ms",
            "1500",
            "--json",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(url, timeout_s=120)
        body = encode_request_bytes(np.zeros((1, 3, 32, 32), dtype=np.float32))

        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                inflight = [
                    asyncio.create_task(
                        c.post(
                            "/v2/models/digits/infer",
                            content=body,
                            headers={"content-type": "application/json"},
                        )
                    )
                    for _ in range(5)
                ]
                # Wait until all five sit in the batch queue (the batch waits 1.5 s to fill).
                while True:
                    text = (await c.get("/metrics")).text
                    m = re.search(
                        r'^hpcml_queue_depth\{model="digits",version="1"\} (\S+)$', text, re.M
                    )
                    if m and float(m.group(1)) == 5:
                        break
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                return [(await t).status_code for t in inflight]

        codes = asyncio.run(main())
        assert codes == [200] * 5
        out, err = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGTERM), err
        assert '"url": "' + url in out  # the --json startup summary
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/v2/health/live")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, "-m", "hpcml", "serve", str(tmp_path / "nope")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    export = _export(tmp_path / "export")
    no_onnx = subprocess.run(
        [sys.executable, "-m", "hpcml", "serve", str(export), "--backend", "onnx", "--port", "0"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert no_onnx.returncode == 2
    assert "hpcml export onnx" in no_onnx.stderr and "Traceback" not in no_onnx.stderr
