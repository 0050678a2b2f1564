"""Throughput in model FLOPs: tokens/s per device and MFU (model FLOPs utilization, PaLM's
definition: the FLOPs the model needs per sample, not what the hardware executed, over the
device's dense peak for the precision in use).

Peak FLOP/s come from `train.peak_flops` in the config, else the planner's hardware catalog
(`hpcml.plan.hardware`), else a small table here keyed by a substring of the device name (the
longest match wins: "H100 PCIe" before "H100").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcml.plan.hardware import peak_flops_per_s as catalog_peak_flops_per_s

# Dense (no 2:4 sparsity) peak FLOP/s per device, from the vendors' data sheets.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "GH200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},  # SXM
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 654e12, "fp32": 163.4e12},
    "MI250X": {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12},
}


def peak_flops_per_s(device_name: str, precision: str) -> float | None:
    """Peak of one device for `precision` (fp32 | tf32 | bf16 | fp16), or None if unknown:
    the planner's hardware catalog first (one source of truth for plan and measurement),
    then this module's table for devices the catalog does not list."""
    found = catalog_peak_flops_per_s(device_name, precision)
    return found if found else table_peak_flops_per_s(device_name, precision)


def table_peak_flops_per_s(device_name: str, precision: str) -> float | None:
    """This module's own table: the longest key contained in the device name wins."""
    matches = [key for key in PEAK_FLOPS if key.lower() in device_name.lower()]
    if not matches:
        return None
    return PEAK_FLOPS[max(matches, key=len)].get(precision)


@dataclass
class Workload:
    tokens_per_sample: int
    """1 for one-label-per-sample tasks; the sequence length for language models."""
    train_flops_per_sample: float
    peak_flops_per_s: float | None
    """Per device, for the precision in use."""
    devices: int

    def rates(self, samples_per_s: float | None) -> dict[str, Any]:
        if not samples_per_s:
            return {}
        per_device = samples_per_s / self.devices
        achieved = per_device * self.train_flops_per_sample
        out: dict[str, Any] = {}
        if self.tokens_per_sample > 1:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
            out["tokens_per_s_per_device"] = per_device * self.tokens_per_sample
        out["model_flops_per_s_per_device"] = achieved
        out["mfu"] = achieved / self.peak_flops_per_s if self.peak_flops_per_s else None
        return out


def workload(
    train_flops_per_token: int | None,
    forward_flops_per_sample: int,
    input_shape: tuple[int, ...],
    input_dtype: str,
    device: dict[str, Any],
    precision: str,
    peak_override: float | None,
    devices: int,
) -> Workload:
    """Language models (a per-token formula and integer token inputs) count 6N + attention
    per token; other models count three times the forward FLOPs (forward + 2x backward)."""
    tokens = int(input_shape[0]) if input_dtype.startswith("int") and input_shape else 1
    if train_flops_per_token is not None and tokens > 1:
        flops = float(train_flops_per_token * tokens)
    else:
        flops = 3.0 * forward_flops_per_sample
    peak = peak_override or peak_flops_per_s(str(device.get("name", "")), precision)
    return Workload(tokens, flops, peak, devices)


def run_workload(
    cfg: Any, resolved: Any, rt: Any, spec: Any, forward_flops_per_sample: int
) -> Workload:
    """`workload` for a run: its model's FLOPs formula, its data's input and its devices."""
    from hpcml.distributed.runtime import device_info

    per_token = spec.train_flops_per_token_fn
    return workload(
        per_token(resolved.model_args) if per_token else None,
        forward_flops_per_sample,
        resolved.splits.input_shape,
        resolved.splits.input_dtype,
        device_info(rt),
        cfg.precision,
        cfg.train.peak_flops,
        rt.world_size,
    )
