"""MFU: peak table lookup and the rates a step record carries."""

from __future__ import annotations

import pytest

from hpcml.train.mfu import peak_flops_per_s, table_peak_flops_per_s, workload


def test_longest_name_match_wins() -> None:
    assert table_peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert table_peak_flops_per_s("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak_flops_per_s("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert table_peak_flops_per_s("x86_64", "fp32") is None
    assert table_peak_flops_per_s("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on Volta


def test_lookup_knows_gpus_not_cpus() -> None:
    # The planner's catalog, when installed, takes precedence; either source knows an H100.
    assert (peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16") or 0) > 5e14
    assert peak_flops_per_s("x86_64", "fp32") is None


def test_language_model_rates() -> None:
    w = workload(
        train_flops_per_token=1000,
        forward_flops_per_sample=0,
        input_shape=(64,),
        input_dtype="int64",
        device={"name": "NVIDIA H100 80GB HBM3"},
        precision="bf16",
        peak_override=None,
        devices=2,
    )
    rates = w.rates(10.0)  # 10 samples/s over 2 devices
    assert rates["tokens_per_s"] == 640 and rates["tokens_per_s_per_device"] == 320
    assert rates["model_flops_per_s_per_device"] == 320 * 1000
    peak = peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16")
    assert peak is not None and rates["mfu"] == pytest.approx(320_000 / peak)


def test_classifier_counts_three_forwards_and_override() -> None:
    w = workload(None, 100, (3, 32, 32), "float32", {"name": "cpu"}, "fp32", 1e6, 1)
    rates = w.rates(50.0)
    assert "tokens_per_s" not in rates
    assert rates["model_flops_per_s_per_device"] == 50 * 300
    assert rates["mfu"] == pytest.approx(50 * 300 / 1e6)
    assert w.rates(None) == {}
