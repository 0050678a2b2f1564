"""The hardware catalog: required entries, device-name matching, user extension."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcml.plan.common import PlanError
from hpcml.plan.hardware import (
    CATALOG_ENV,
    load_catalog,
    match_accelerator,
    peak_flops_per_s,
    resolve_cluster,
)


def test_catalog_has_what_the_issue_asks_for() -> None:
    cat = load_catalog()
    for key in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4",
                "mi300x", "cpu"):
        acc = cat.accelerator(key)
        assert acc.peak("fp32") > 0 and acc.tdp_watts > 0
    for key in ("nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "ib-xdr",
                "roce-100", "roce-200", "roce-400", "eth-10", "eth-25", "eth-100"):
        assert cat.link(key).bandwidth_bytes_per_s > 0
    hgx = cat.node("hgx-h100")
    assert (hgx.devices_per_node, hgx.intra_link, hgx.nics_per_node) == (8, "nvlink4", 8)
    assert cat.link(hgx.inter_link).bandwidth_bytes_per_s == 50e9  # 400 Gb/s
    # Dense (not sparse) datasheet peaks.
    assert cat.accelerator("h100-sxm").peak("bf16") == pytest.approx(989.4e12)
    assert cat.accelerator("a100-80gb").peak("tf32") == pytest.approx(156e12)
    for acc in cat.accelerators.values():
        for offer in acc.prices:
            assert offer.as_of, f"{acc.key}: prices must be dated"


@pytest.mark.parametrize(
    "name,key,bf16",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.4e12),
        ("NVIDIA H100 PCIe", "h100-pcie", 756e12),
        ("NVIDIA H200", "h200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312e12),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312e12),
        ("NVIDIA L4", "l4", 121e12),
        ("AMD Instinct MI300X", "mi300x", 1307.4e12),
        ("cpu", "cpu", 768e9),
    ],
)
def test_torch_device_names_match(name: str, key: str, bf16: float) -> None:
    acc = match_accelerator(load_catalog(), name)
    assert acc is not None and acc.key == key
    assert peak_flops_per_s(name, "bf16") == pytest.approx(bf16)


def test_unknown_devices_and_precisions_give_none() -> None:
    assert peak_flops_per_s("Tesla V100-SXM2-16GB", "fp16") is None
    assert peak_flops_per_s("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on Ampere
    assert peak_flops_per_s("cpu", "tf32") == peak_flops_per_s("cpu", "fp32")
    with pytest.raises(PlanError, match="not in the hardware catalog"):
        load_catalog().accelerator("v100")


def test_user_catalog_adds_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = tmp_path / "mine.yaml"
    extra.write_text(
        "accelerators:\n"
        "  v100:\n"
        "    match: ['v100']\n"
        "    memory_bytes: 17179869184\n"
        "    memory_bandwidth_bytes_per_s: 900e9\n"
        "    peak_flops: {fp32: 15.7e12, fp16: 125e12}\n"
        "    tdp_watts: 300\n"
        "    default_node: dgx1\n"
        "  h100-sxm:\n"
        "    memory_bandwidth_bytes_per_s: 3.35e12\n"
        "    peak_flops: {bf16: 1.0e15}\n"
        "links:\n"
        "  nvlink2: {bandwidth_bytes_per_s: 150e9, latency_s: 3e-6}\n"
        "nodes:\n"
        "  dgx1: {accelerator: v100, devices_per_node: 8, intra_link: nvlink2,"
        " inter_link: ib-hdr, nics_per_node: 4}\n"
    )
    cat = load_catalog([extra])
    assert cat.accelerator("Tesla V100-SXM2-16GB").peak("fp16") == 125e12
    assert cat.accelerator("h100-sxm").peak("bf16") == 1.0e15
    cluster = resolve_cluster(cat, 16, accelerator="v100")
    assert cluster.intra.key == "nvlink2" and cluster.nics_per_node == 4
    monkeypatch.setenv(CATALOG_ENV, str(extra))
    assert peak_flops_per_s("Tesla V100-SXM2-16GB", "fp16") == 125e12


def test_bad_user_catalogs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: {}\n")
    with pytest.raises(PlanError, match="unknown top-level keys"):
        load_catalog([bad])
    bad.write_text("nodes:\n  n: {accelerator: nope, devices_per_node: 8, intra_link: nvlink4,"
                   " inter_link: ib-ndr}\n")
    with pytest.raises(PlanError, match="names 'nope'"):
        load_catalog([bad])
    with pytest.raises(PlanError, match="does not exist"):
        load_catalog([tmp_path / "missing.yaml"])
