"""`hpcml export onnx` and the ONNX Runtime / torch.compile backends behind the real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.app import build_app
from hpcml.serve.config import ServeConfig
from hpcml.serve.onnx_export import export_onnx
from hpcml.serve.protocol import decode_output, encode_request_bytes
from hpcml.serve.testing import running_server

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = {"hidden": 32, "depth": 1}


def _export(path: Path, data: dict | None) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    meta = {"data": data} if data else {}
    return save_export(path, model, "mlp", ARGS, (3, 32, 32), (10,), metadata=meta), model


def test_export_onnx_int8_cli_reports_checks_accuracy_and_speed(tmp_path: Path) -> None:
    export, model = _export(tmp_path / "run" / "export", {"source": "digits"})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcml",
            "export",
            "onnx",
            str(tmp_path / "run"),
            "--int8",
            "--json",
        ],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [c["batch"] for c in report["check"]] == [1, 7] and all(c["ok"] for c in report["check"])
    acc = report["accuracy"]
    assert acc["measured"] and acc["samples"] == 359  # digits validation split
    assert acc["torch"] == pytest.approx(acc["onnx"], abs=1 / 359)
    assert acc["int8_minus_fp32"] == pytest.approx(acc["onnx-int8"] - acc["onnx"])
    assert 0.0 <= acc["int8_agreement_with_fp32"] <= 1.0
    for row in report["speed"].values():
        assert set(row) == {"torch", "onnx", "onnx-int8", "int8_speedup_vs_fp32"}
    assert (export / "onnx_report.json").exists()

    # The batch axis is dynamic and the quantized model really uses integer kernels.
    for name in ("model.onnx", "model.int8.onnx"):
        session = ort.InferenceSession(str(export / name), providers=["CPUExecutionProvider"])
        assert isinstance(session.get_inputs()[0].shape[0], str)
        assert session.run(None, {"input": np.zeros((5, 3, 32, 32), np.float32)})[0].shape == (
            5,
            10,
        )
    import onnx

    ops = {n.op_type for n in onnx.load(str(export / "model.int8.onnx")).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops

    # Served: the fp32 ONNX backend answers as torch does; INT8 stays close.
    cfg = ServeConfig.model_validate(
        {
            "models": {
                "digits": {
                    "backend": "onnx",
                    "versions": {"2": {"path": str(export), "backend": "onnx-int8"}},
                }
            }
        }
    )
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with torch.inference_mode():
        expected = model(torch.from_numpy(x)).numpy()
    with (
        running_server(build_app(export, cfg, name="digits")) as url,
        httpx.Client(base_url=url) as c,
    ):
        assert c.get("/v2/models/digits/versions/1").json()["platform"] == "onnxruntime_onnx"
        headers = {"content-type": "application/json"}
        fp32 = decode_output(
            c.post(
                "/v2/models/digits/versions/1/infer",
                content=encode_request_bytes(x),
                headers=headers,
            ).json()
        )
        int8 = decode_output(
            c.post(
                "/v2/models/digits/versions/2/infer",
                content=encode_request_bytes(x),
                headers=headers,
            ).json()
        )
    np.testing.assert_allclose(fp32, expected, rtol=1e-4, atol=1e-5)
    assert np.abs(int8 - expected).max() < 0.1 * np.abs(expected).max()


def test_accuracy_change_says_why_it_cannot_be_measured(tmp_path: Path) -> None:
    export, _ = _export(tmp_path / "export", None)
    report = export_onnx(export, int8=False, speed_budget_s=0.05)
    assert report["accuracy"] == {
        "measured": False,
        "reason": "could not be measured: the export carries no data config and no run config.yaml "
        "was found next to it.",
    }
    assert (export / "model.onnx").exists()
