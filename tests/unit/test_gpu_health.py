"""GPU health pre-flight: the sentences a reading turns into, NVML's clock-reason bits decoded
with the real nvidia-ml-py constants, and the CPU path (no GPU: nothing checked, training is
not refused). Reading a real GPU through NVML needs one (tests/integration/test_fault_gpu.py
runs on a lent GPU)."""

from __future__ import annotations

import pynvml
import torch
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.observe.gpu_health import GpuReading, preflight, problems, reason_names

UUID = "GPU-5a1b2c3d-0000-1111-2222-333344445555"


def _reading(**kw: object) -> GpuReading:
    base = {
        "ecc_uncorrected": 0,
        "retired_pages_pending": False,
        "remap_pending": False,
        "remap_failed": False,
        "pcie_width": 16,
        "pcie_width_max": 16,
    }
    return GpuReading(3, UUID, "NVIDIA H100 80GB HBM3", **{**base, **kw})  # type: ignore[arg-type]


def test_a_healthy_reading_has_no_problem() -> None:
    # What an idle, healthy GPU shows: idle clocks, the software power cap, no ECC errors.
    assert problems(_reading(clock_reasons=["GpuIdle", "SwPowerCap"])) == []
    # Counters a device does not support (consumer GPUs: no ECC) are None, not problems.
    assert problems(GpuReading(0, UUID, "GeForce")) == []


def test_each_fault_is_one_sentence_naming_the_device() -> None:
    cases = {
        "ecc": _reading(ecc_uncorrected=2),
        "pending": _reading(remap_pending=True),
        "retired": _reading(retired_pages_pending=True),
        "remap failed": _reading(remap_failed=True),
        "thermal": _reading(clock_reasons=["GpuIdle", "HwThermalSlowdown"]),
        "pcie": _reading(pcie_width=8),
        "other process": _reading(other_processes=[(4242, 3 * 2**30)]),
    }
    for what, reading in cases.items():
        found = problems(reading)
        assert len(found) == 1, (what, found)
        line = found[0]
        assert line.startswith(f"GPU 3 (NVIDIA H100 80GB HBM3, {UUID})"), line
        assert line.endswith(".") and "\n" not in line
    assert "2 uncorrected ECC" in problems(cases["ecc"])[0]
    assert "x8 of x16" in problems(cases["pcie"])[0]
    assert "process 4242 (3072 MiB)" in problems(cases["other process"])[0]
    assert len(problems(_reading(ecc_uncorrected=1, pcie_width=4, remap_failed=True))) == 3


def test_clock_reason_bits_decode_with_nvmls_own_constants() -> None:
    mask = pynvml.nvmlClocksThrottleReasonGpuIdle | pynvml.nvmlClocksThrottleReasonHwSlowdown
    assert reason_names(pynvml, mask) == ["GpuIdle", "HwSlowdown"]
    assert reason_names(pynvml, 0) == []


def test_no_gpu_means_nothing_checked() -> None:
    assert preflight(torch.device("cpu")) is None
    result = CliRunner().invoke(app, ["observe", "health"])
    if not torch.cuda.is_available():
        assert result.exit_code == 0, result.output
        assert "no GPU" in result.output
