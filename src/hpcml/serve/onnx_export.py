"""`hpcml export onnx`: an ONNX model with a dynamic batch axis, checked against torch, and an
optional INT8 copy made by ONNX Runtime dynamic quantization, with its accuracy and speed
change measured side by side.

The exporter is torch's dynamo-based `torch.onnx.export(dynamo=True)` (the TorchScript one is
deprecated). Dynamic quantization covers MatMul/Gemm (every nn.Linear): ONNX Runtime's CPU
ConvInteger kernel is several times slower than its fp32 Conv, so convolutions stay fp32.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.errors import ModelError, WorkFailed
from hpcml.records import write_json_atomic
from hpcml.serve.backends import ONNX_FILE, ONNX_INT8_FILE, export_dir_of

REPORT_FILE = "onnx_report.json"
QUANTIZED_OPS = ["MatMul", "Gemm"]


@contextlib.contextmanager
def _quiet() -> Any:
    """The exporter and quantizer print progress and warnings a CLI user cannot act on."""
    loggers = [
        logging.getLogger(n)
        for n in ("", "torch.onnx", "torch._dynamo", "torch.export", "onnxscript")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _validation_data(export_dir: Path, meta: dict[str, Any]) -> tuple[Any, str]:
    """(validation Dataset or None, where its config came from or why there is none)."""
    from hpcml.config import DataConfig, load_config
    from hpcml.data.sources import load_source

    data_cfg = (meta.get("metadata") or {}).get("data")
    if data_cfg:
        return load_source(DataConfig(**data_cfg)).val, "the export's metadata"
    for run_config in (export_dir.parent / "config.yaml", export_dir / "config.yaml"):
        if run_config.exists():
            return load_source(load_config(run_config).data).val, str(run_config)
    return None, "the export carries no data config and no run config.yaml was found next to it"


def _val_arrays(val: Any, limit: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    n = min(len(val), limit)
    xs, ys = zip(*(val[i] for i in range(n)), strict=True)
    return torch.stack(list(xs)).numpy(), torch.as_tensor(ys).numpy()


def _accuracy(run: Any, x: np.ndarray, y: np.ndarray, batch: int = 256) -> tuple[float, np.ndarray]:
    preds = np.concatenate([run(x[i : i + batch]).argmax(1) for i in range(0, len(x), batch)])
    return float((preds == y).mean()), preds


def _samples_per_s(run: Any, x: np.ndarray, budget_s: float) -> float:
    run(x)
    n, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < budget_s or n < 3:
        run(x)
        n += 1
    return n * len(x) / elapsed


def export_onnx(
    path: Path,
    int8: bool = False,
    opset: int | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
    val_limit: int = 10_000,
    speed_budget_s: float = 0.5,
    trust_code: bool = False,
) -> dict[str, Any]:
    """Write model.onnx (and model.int8.onnx) into the export folder; return the report.

    `trust_code` lets a model.json that names an import path run that code."""
    import torch

    from hpcml.models.export import example_input, load_export

    export_dir = export_dir_of(path)
    model, meta = load_export(export_dir, trust_code=trust_code)
    in_name = meta["input"].get("name", "input")
    out_name = meta["output"].get("name", "logits")
    onnx_path = export_dir / ONNX_FILE
    started = time.perf_counter()
    try:
        with _quiet():
            program = torch.onnx.export(
                model,
                (example_input(meta, batch=2),),
                None,
                input_names=[in_name],
                output_names=[out_name],
                dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
                opset_version=opset,
                dynamo=True,
                verbose=False,
            )
            if program is None:
                raise RuntimeError("the exporter returned no program")
            program.save(str(onnx_path))
    except Exception as exc:  # noqa: BLE001 - the exporter raises many types for one problem
        raise WorkFailed(
            f"torch.onnx.export could not export {meta['architecture']} from {export_dir} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})."
        ) from None
    report: dict[str, Any] = {
        "export_dir": str(export_dir),
        "architecture": meta["architecture"],
        "onnx": str(onnx_path),
        "onnx_bytes": onnx_path.stat().st_size,
        "export_s": round(time.perf_counter() - started, 3),
    }

    val, data_origin = _validation_data(export_dir, meta)
    val_x: np.ndarray | None = None
    val_y: np.ndarray | None = None
    if val is not None:
        val_x, val_y = _val_arrays(val, val_limit)

    def run_torch(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out: np.ndarray = model(torch.from_numpy(x)).numpy()
        return out

    session = _session(onnx_path)

    def run_onnx(x: np.ndarray, s: Any = session) -> np.ndarray:
        out: np.ndarray = s.run(None, {in_name: x})[0]
        return out

    # Check on batch sizes other than the example's, so a baked-in batch axis is caught.
    checks = []
    for batch in (1, 7):
        if val_x is not None and len(val_x) >= batch:
            x = np.ascontiguousarray(val_x[:batch])
        else:
            x = example_input(meta, batch=batch).numpy()
        ref, got = run_torch(x), run_onnx(x)
        diff = float(np.max(np.abs(ref - got))) if ref.size else 0.0
        ok = ref.shape == got.shape and bool(np.allclose(ref, got, rtol=rtol, atol=atol))
        checks.append({"batch": batch, "max_abs_diff": diff, "ok": ok})
        if not ok:
            raise WorkFailed(
                f"{onnx_path} disagrees with torch on batch {batch} (max |diff| {diff:.3g} > "
                f"atol {atol:g} + rtol {rtol:g}); the export is not faithful, do not serve it."
            )
    report["check"] = checks

    runners: dict[str, Any] = {"torch": run_torch, "onnx": run_onnx}
    if int8:
        int8_path = _quantize(onnx_path, export_dir / ONNX_INT8_FILE)
        int8_session = _session(int8_path)
        runners["onnx-int8"] = lambda x: run_onnx(x, int8_session)
        report["onnx_int8"] = str(int8_path)
        report["onnx_int8_bytes"] = int8_path.stat().st_size
        report["quantized_ops"] = QUANTIZED_OPS

    report["accuracy"] = _accuracy_report(runners, val_x, val_y, meta, data_origin)
    report["speed"] = _speed_report(runners, meta, val_x, speed_budget_s)
    write_json_atomic(export_dir / REPORT_FILE, report)
    return report


def _session(path: Path) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # Spinning worker threads would steal the CPU from torch in the side-by-side timing.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _quantize(src: Path, dst: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = dst.with_suffix(".pre.onnx")
    try:
        with _quiet():
            # Shape inference + graph cleanup first, as ONNX Runtime's quantization guide asks.
            quant_pre_process(str(src), str(pre))
            quantize_dynamic(
                str(pre), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=QUANTIZED_OPS
            )
    except Exception as exc:  # noqa: BLE001
        raise WorkFailed(
            f"ONNX Runtime could not quantize {src} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]})."
        ) from None
    finally:
        pre.unlink(missing_ok=True)
    return dst


def _accuracy_report(
    runners: dict[str, Any],
    x: np.ndarray | None,
    y: np.ndarray | None,
    meta: dict[str, Any],
    origin: str,
) -> dict[str, Any]:
    out_shape = meta["output"]["shape"]
    if x is None or y is None:
        return {"measured": False, "reason": f"could not be measured: {origin}."}
    if meta.get("task") != "classification" or len(out_shape) != 1:
        return {
            "measured": False,
            "reason": "could not be measured: the model is not a classifier.",
        }
    acc: dict[str, Any] = {"measured": True, "data_config_from": origin, "samples": int(len(y))}
    preds = {}
    for name, run in runners.items():
        acc[name], preds[name] = _accuracy(run, x, y)
    if "onnx-int8" in runners:
        acc["int8_minus_fp32"] = acc["onnx-int8"] - acc["onnx"]
        acc["int8_agreement_with_fp32"] = float((preds["onnx-int8"] == preds["onnx"]).mean())
    return acc


def _speed_report(
    runners: dict[str, Any], meta: dict[str, Any], val_x: np.ndarray | None, budget_s: float
) -> dict[str, Any]:
    from hpcml.models.export import example_input

    speed: dict[str, Any] = {}
    for batch in (1, 32):
        if val_x is not None and len(val_x) >= batch:
            x = np.ascontiguousarray(val_x[:batch])
        else:
            x = example_input(meta, batch=batch).numpy()
        # Interleaved rounds, best of three: a burst of load from elsewhere hits every runner.
        row = {name: 0.0 for name in runners}
        for _ in range(3):
            for name, run in runners.items():
                row[name] = max(row[name], _samples_per_s(run, x, budget_s / 3))
        if "onnx-int8" in row:
            row["int8_speedup_vs_fp32"] = row["onnx-int8"] / row["onnx"]
        speed[f"batch_{batch}_samples_per_s"] = row
    return speed


def check_export_dir(path: Path) -> Path:
    export_dir = export_dir_of(path)
    if not (export_dir / "model.json").exists():
        raise ModelError(
            f"{path} holds no exported model (model.json); pass a run folder or its export/ folder."
        )
    return export_dir
