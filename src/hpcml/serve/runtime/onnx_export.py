"""`hpcml export onnx`: an ONNX model with a dynamic batch axis, checked against torch, and an
optional INT8 copy made by ONNX Runtime dynamic quantization, with its accuracy and speed
change measured side by side.

The exporter is torch's dynamo-based `torch.onnx.export(dynamo=True)` (the TorchScript one is
deprecated). Dynamic quantization covers MatMul/Gemm (every nn.Linear): ONNX Runtime's CPU
ConvInteger kernel is several times slower than its fp32 Conv, so convolutions stay fp32.

INT8 settings follow ONNX Runtime's quantization guide ("Data type selection", "When to use
reduce-range and per-channel quantization"): activations are quantized to uint8 at run time and
weights to int8 (U8S8). On x86-64 CPUs without VNNI, ONNX Runtime computes U8S8 products with
VPMADDUBSW, which adds two u8*s8 products into a saturating int16: 2 * 255 * 127 = 64770 does not
fit in 32767, so 8-bit weights can be clamped. `reduce_range` quantizes weights to 7 bits
([-64, 64]: 2 * 255 * 64 = 32640 fits), which the guide prescribes for those CPUs; per-channel
weight scales win back the precision of the lost bit (one scale per output column instead of one
per tensor). CPUs with VNNI (AVX512-VNNI, AVX-VNNI) and ARM have no such saturation and keep
8-bit weights. The CPU features are read from /proc/cpuinfo (Linux) or sysctl (macOS): a few
lines of parsing, where a CPU-info package would add a dependency that spawns subprocesses; when
they cannot be read, the 7-bit choice (correct on every CPU) is taken.
"""

from __future__ import annotations

import contextlib
import io
import logging
import platform
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.crypt import file_is_sealed
from hpcml.errors import ModelError, WorkFailed
from hpcml.records import write_json_atomic
from hpcml.serve.runtime.backends import ONNX_FILE, ONNX_INT8_FILE, export_dir_of

REPORT_FILE = "onnx_report.json"
QUANTIZED_OPS = ["MatMul", "Gemm"]
# CPU flags that matter for ONNX Runtime's U8S8 kernels, as Linux names them in /proc/cpuinfo.
X86_FLAGS = ("sse4_1", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
ARM_FLAGS = ("asimd", "asimddp", "i8mm", "sve")  # Linux names; dp/i8mm are int8 dot products


def cpu_features() -> dict[str, Any]:
    """The machine and the int8-relevant features its CPU reports, and where they came from."""
    machine = platform.machine().lower()
    arch = (
        "x86-64"
        if machine in ("x86_64", "amd64", "i386", "i686", "x86")
        else "arm64"
        if machine in ("aarch64", "arm64") or machine.startswith("armv8")
        else machine or "unknown"
    )
    flags: set[str] | None = None
    source = "none"
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags, source = set(value.split()), "/proc/cpuinfo"
            break
    if flags is None and platform.system() == "Darwin":
        flags, source = _darwin_flags(arch)
    known = X86_FLAGS if arch == "x86-64" else ARM_FLAGS if arch == "arm64" else ()
    return {
        "machine": machine,
        "arch": arch,
        "features": sorted(f for f in known if flags and f in flags),
        "source": source if flags is not None else "unknown",
    }


def _darwin_flags(arch: str) -> tuple[set[str] | None, str]:
    keys = (
        ["machdep.cpu.features", "machdep.cpu.leaf7_features"]
        if arch == "x86-64"
        else ["hw.optional.arm.FEAT_DotProd", "hw.optional.arm.FEAT_I8MM"]
    )
    try:
        out = subprocess.run(
            ["sysctl", *keys], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except OSError:
        return None, "none"
    flags = {"asimd"} if arch == "arm64" else set()
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if arch == "arm64" and value.strip() == "1":
            flags.add("asimddp" if key.endswith("DotProd") else "i8mm")
        else:  # x86 sysctl spells flags in capitals without underscores (AVX512VNNI, AVX2)
            names = {v.lower().replace(".", "") for v in value.split()}
            flags |= {f for f in X86_FLAGS if f.replace("_", "") in names}
    return flags, "sysctl"


def int8_settings(cpu: dict[str, Any], reduce_range: bool | None = None) -> dict[str, Any]:
    """ONNX Runtime dynamic-quantization settings for this CPU (see the module docstring)."""
    features = set(cpu["features"])
    x86 = cpu["arch"] == "x86-64"
    if reduce_range is not None:
        why = "set by the caller (--reduce-range / --no-reduce-range)"
    elif x86 and features & set(VNNI_FLAGS):
        reduce_range = False
        why = "x86-64 with VNNI: U8S8 products do not saturate, 8-bit weights"
    elif x86 and cpu["source"] != "unknown":
        reduce_range = True
        why = (
            "x86-64 without VNNI: U8S8 products go through a saturating int16 (VPMADDUBSW), "
            "so weights are quantized to 7 bits as ONNX Runtime's guide prescribes"
        )
    elif cpu["arch"] == "arm64":
        reduce_range = False
        why = "ARM: U8S8 products do not saturate, 8-bit weights"
    else:
        reduce_range = True
        why = "CPU features unknown: 7-bit weights, which cannot saturate on any CPU"
    return {
        "activations": "uint8, scale and zero point computed per batch at run time",
        "weights": "int8 symmetric",
        "reduce_range": reduce_range,
        "per_channel": True,
        "reason": why + "; per-channel weight scales (one per output column)",
    }


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
    reduce_range: bool | None = None,
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
        cpu = cpu_features()
        settings = int8_settings(cpu, reduce_range)
        report["int8_settings"] = {"cpu": cpu, **settings}
        int8_path = _quantize(onnx_path, export_dir / ONNX_INT8_FILE, settings)
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


def _quantize(src: Path, dst: Path, settings: dict[str, Any]) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = dst.with_suffix(".pre.onnx")
    try:
        with _quiet():
            # Shape inference + graph cleanup first, as ONNX Runtime's quantization guide asks.
            quant_pre_process(str(src), str(pre))
            quantize_dynamic(
                str(pre),
                str(dst),
                weight_type=QuantType.QInt8,
                op_types_to_quantize=QUANTIZED_OPS,
                per_channel=settings["per_channel"],
                reduce_range=settings["reduce_range"],
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
    weights = export_dir / "model.safetensors"
    if weights.is_file() and file_is_sealed(weights):
        raise ModelError(
            f"{weights} is encrypted and an ONNX file would hold its weights in the clear; "
            "serve the encrypted export with the torch backend instead."
        )
    return export_dir
