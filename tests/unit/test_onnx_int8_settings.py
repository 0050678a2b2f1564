"""`hpcml export onnx --int8` picks ONNX Runtime's quantization settings from the CPU features."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from hpcml.serve.runtime.onnx_export import cpu_features, int8_settings


def _cpu(arch: str, *features: str, source: str = "/proc/cpuinfo") -> dict:
    return {"machine": arch, "arch": arch, "features": sorted(features), "source": source}


@pytest.mark.parametrize(
    ("cpu", "reduce_range"),
    [
        # ONNX Runtime's guide: U8S8 saturates on AVX2 / AVX512 without VNNI -> 7-bit weights.
        (_cpu("x86-64", "sse4_1", "avx2"), True),
        (_cpu("x86-64", "sse4_1", "avx2", "avx512f", "avx512bw"), True),
        # VNNI (AVX512 or the AVX-VNNI of client CPUs) and ARM do not saturate -> 8-bit weights.
        (_cpu("x86-64", "avx2", "avx512f", "avx512_vnni"), False),
        (_cpu("x86-64", "avx2", "avx_vnni"), False),
        (_cpu("arm64", "asimd", "asimddp"), False),
        # Features unknown: the choice that is correct on every CPU.
        (_cpu("x86-64", source="unknown"), True),
        (_cpu("riscv64", source="unknown"), True),
    ],
)
def test_int8_settings_follow_onnxruntime_guidance(cpu: dict, reduce_range: bool) -> None:
    settings = int8_settings(cpu)
    assert settings["reduce_range"] is reduce_range and settings["per_channel"] is True
    assert int8_settings(cpu, reduce_range=not reduce_range)["reduce_range"] is not reduce_range


def test_cpu_features_reads_this_machine() -> None:
    cpu = cpu_features()
    flags_file = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not flags_file.exists():
        pytest.skip("checked against /proc/cpuinfo on Linux x86-64 only")
    flags = next(
        set(line.split(":", 1)[1].split())
        for line in flags_file.read_text().splitlines()
        if line.startswith("flags")
    )
    assert cpu["arch"] == "x86-64" and cpu["source"] == "/proc/cpuinfo"
    assert set(cpu["features"]) == flags & {
        "sse4_1",
        "avx2",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx_vnni",
        "amx_int8",
    }
