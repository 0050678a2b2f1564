"""`hpcml export onnx` and the ONNX Runtime / torch.compile backends behind the real server."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch

from hpcml.config import DataConfig
from hpcml.data.sources import load_source
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import decode_output, encode_request_bytes
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.runtime.onnx_export import export_onnx
from hpcml.serve.testing import running_server

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = {"hidden": 32, "depth": 1}
# Unit roundoff of float32: every fp32 operation is exact up to a factor (1 + d), |d| <= U32.
U32 = float(np.finfo(np.float32).eps) / 2


def _export(path: Path, data: dict | None, train_steps: int = 0) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS)
    if train_steps:
        # A few seeded SGD steps on digits (~94% validation accuracy, median top-2 logit margin
        # ~4): on an untrained model the logits are ~0.1 apart and INT8 vs fp32 argmax is noise.
        x, y = load_source(DataConfig(source="digits")).train.tensors
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        for _ in range(train_steps):
            idx = torch.randint(0, len(y), (64,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    meta = {"data": data} if data else {}
    return save_export(path, model, "mlp", ARGS, (3, 32, 32), (10,), metadata=meta), model


def _int8_bound(
    model: torch.nn.Module, int8_onnx: Path, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(exact logits in float64, element-wise bound on |INT8 logits - exact logits|) for one batch.

    Derivation, per quantized MatMul y = x W + b (x: n x K, W: K x N), whose input reaches the
    INT8 graph as x~ with |x~ - x| <= e element-wise (e = 0 for the first layer):
    - ONNX DynamicQuantizeLinear: s_x = (max(0, max x~) - min(0, min x~)) / 255 over the whole
      batch tensor, zp = round(-min(0, min x~) / s_x), q = saturate(round(x~ / s_x) + zp), and
      x^ = s_x * (q - zp). Rounding half to even is odd-symmetric (round(-a) = -round(a)), so
      round(x~ / s_x) + zp stays in [0, 255]: q - zp = round(x~ / s_x) and |x^ - x~| <= s_x / 2,
      with s_x <= (max(0, max(x + e)) - min(0, min(x - e))) / 255.
    - The weights are fixed: W^ = s_w * (q_w - zp_w), read from the graph's initializers.
    - MatMulInteger accumulates in int32, exactly when no partial sum saturates (that is what
      reduce_range buys on x86 without VNNI), so the graph computes x^ W^ + b up to fp32 roundoff.
    - x^ W^ - x W = (x^ - x~) W^ + (x~ - x) W^ + x (W^ - W), hence
      |y~ - y| <= (s_x / 2) * sum_k |W^_kj| + (e @ |W^|)_j + |x @ (W^ - W)|_j + fp32 roundoff,
      where the int32 -> fp32 cast, the scale product, the rescale and the bias add round once
      each (U32 relative): about 4 U32 * (|x^| @ |W^| + |b|), and |x^| <= |x| + e + s_x / 2, so
      8 U32 * ((|x| + e + s_x) @ |W^| + |b|) covers it twice over.
    - ReLU is 1-Lipschitz and Flatten is exact, so the bound of one layer is the e of the next.
    Each term comes from a scale or a weight of the graph, nothing from an observed error.
    """
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(int8_onnx)).graph
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in graph.initializer}
    nodes = [n for n in graph.node if n.op_type == "MatMulInteger"]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(nodes) == len(linears), [n.op_type for n in graph.node]
    x = x.reshape(len(x), -1).astype(np.float64)
    e = np.zeros_like(x)
    for i, (node, linear) in enumerate(zip(nodes, linears, strict=True)):
        w = linear.weight.detach().numpy().T.astype(np.float64)
        b = linear.bias.detach().numpy().astype(np.float64)
        q_name = node.input[1]
        scale = inits[q_name.removesuffix("_quantized") + "_scale"]
        w_hat = scale * (inits[q_name] - inits[node.input[3]])
        # Round-to-nearest weights: |W^ - W| <= s_w / 2, plus the fp32 roundoff of W / s_w
        # (|W / s_w| <= 127, so 127 * 2 U32 in units of s_w).
        assert (np.abs(w_hat - w) <= scale * (0.5 + 254 * U32)).all(), f"weights of {q_name}"
        s_x = (max(0.0, (x + e).max()) - min(0.0, (x - e).min())) / 255
        abs_w = np.abs(w_hat)
        err = s_x / 2 * abs_w.sum(0) + e @ abs_w + np.abs(x @ (w_hat - w))
        err += 8 * U32 * ((np.abs(x) + e + s_x) @ abs_w + np.abs(b))
        y = x @ w + b
        x, e = (np.maximum(y, 0.0), err) if i < len(linears) - 1 else (y, err)
    return x, e


def _fp32_bound(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """Element-wise bound on |fp32 logits - exact logits| for any summation order: a K-term dot
    product plus the bias is within gamma_(K+1) = (K+1)u / (1 - (K+1)u) of (|x| @ |W| + |b|)
    (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5), and the input error e of
    a layer adds e @ |W| (ReLU is 1-Lipschitz)."""
    x = x.reshape(len(x), -1).astype(np.float64)
    e = np.zeros_like(x)
    for linear in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
        w = linear.weight.detach().numpy().T.astype(np.float64)
        b = linear.bias.detach().numpy().astype(np.float64)
        gamma = (w.shape[0] + 1) * U32 / (1 - (w.shape[0] + 1) * U32)
        e = e @ np.abs(w) + gamma * ((np.abs(x) + e) @ np.abs(w) + np.abs(b))
        x = np.maximum(x @ w + b, 0.0)  # the input of the next layer (unused after the last)
    return e


def _on_non_vnni_x86() -> bool:
    """ONNX Runtime's guide: U8S8 may saturate on x86-64 with AVX2/AVX512 but no VNNI."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpuinfo.exists():
        return False
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split())
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


def test_export_onnx_int8_cli_reports_checks_accuracy_and_speed(tmp_path: Path) -> None:
    export, model = _export(tmp_path / "run" / "export", {"source": "digits"}, train_steps=100)
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
    # fp32 ONNX and torch differ by summation order only (the export check holds them within
    # 1e-4), so at most a sample whose top-2 logits tie to 1e-4 can change: allow one of 359.
    assert acc["torch"] == pytest.approx(acc["onnx"], abs=1 / 359)
    assert acc["int8_minus_fp32"] == pytest.approx(acc["onnx-int8"] - acc["onnx"])
    for row in report["speed"].values():
        assert set(row) == {"torch", "onnx", "onnx-int8", "int8_speedup_vs_fp32"}
    assert json.loads((export / "onnx_report.json").read_text()) == report

    # The INT8 settings follow ONNX Runtime's guide for the CPU the export ran on, and the graph
    # holds what the report says: 7-bit weights whenever reduce_range is on.
    q = report["int8_settings"]
    assert q["per_channel"] and q["cpu"]["arch"] in ("x86-64", "arm64")
    if _on_non_vnni_x86():
        assert q["reduce_range"] and "avx512_vnni" not in q["cpu"]["features"], q
    import onnx
    from onnx import numpy_helper

    int8_graph = onnx.load(str(export / "model.int8.onnx")).graph
    weights = [
        numpy_helper.to_array(i) for i in int8_graph.initializer if i.name.endswith("_quantized")
    ]
    assert weights and all(w.dtype == np.int8 for w in weights)
    # 2 * 255 * 64 = 32640 <= 32767: no int16 pair sum of VPMADDUBSW can saturate.
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) <= (
        64 if q["reduce_range"] else 127
    )

    # The batch axis is dynamic and the quantized model really uses integer kernels.
    for name in ("model.onnx", "model.int8.onnx"):
        session = ort.InferenceSession(str(export / name), providers=["CPUExecutionProvider"])
        assert isinstance(session.get_inputs()[0].shape[0], str)
        assert session.run(None, {"input": np.zeros((5, 3, 32, 32), np.float32)})[0].shape == (
            5,
            10,
        )
    assert {n.op_type for n in int8_graph.node} & {"MatMulInteger", "DynamicQuantizeMatMul"}

    # Every INT8 logit on the validation set lies within the bound derived from the scales.
    val_x, _ = load_source(DataConfig(source="digits")).val.tensors
    val_x = val_x.numpy()
    int8_session = ort.InferenceSession(
        str(export / "model.int8.onnx"), providers=["CPUExecutionProvider"]
    )
    fp32_session = ort.InferenceSession(
        str(export / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    int8_out = int8_session.run(None, {"input": val_x})[0]
    fp32_pred = fp32_session.run(None, {"input": val_x})[0].argmax(1)
    exact, bound = _int8_bound(model, export / "model.int8.onnx", val_x)
    assert (np.abs(int8_out - exact) <= bound).all(), np.abs(int8_out - exact).max()
    # A sample whose exact top logit beats every other by more than both bounds cannot change
    # its prediction under INT8 (the bound dominates any batching, the scale only shrinks).
    top = exact.argmax(1)
    rows = np.arange(len(top))
    others = np.where(np.eye(10, dtype=bool)[top], -np.inf, exact + bound).max(1)
    sure = exact[rows, top] - bound[rows, top] > others
    # Guards the test itself: training must leave most predictions decidable, or this says little.
    assert sure.mean() > 0.5, sure.mean()
    assert (int8_out.argmax(1)[sure] == top[sure]).all() and (fp32_pred[sure] == top[sure]).all()
    assert acc["int8_agreement_with_fp32"] >= sure.mean()

    # Served: the fp32 ONNX backend answers as torch does; INT8 stays within its bound.
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
    x = np.ascontiguousarray(val_x[:4])
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
    # Two fp32 evaluations of the same net, each within _fp32_bound of the exact logits.
    assert (np.abs(fp32 - expected) <= 2 * _fp32_bound(model, x)).all()
    exact, bound = _int8_bound(model, export / "model.int8.onnx", x)
    assert (np.abs(int8 - exact) <= bound).all(), np.abs(int8 - exact).max()


def test_accuracy_change_says_why_it_cannot_be_measured(tmp_path: Path) -> None:
    export, _ = _export(tmp_path / "export", None)
    report = export_onnx(export, int8=False, speed_budget_s=0.05)
    assert report["accuracy"] == {
        "measured": False,
        "reason": "could not be measured: the export carries no data config and no run config.yaml "
        "was found next to it.",
    }
    assert (export / "model.onnx").exists()
