"""GPU paths of transformer training: bf16 + compile + FlashAttention on one CUDA device, with
MFU and peak memory in the summary; FSDP with a bf16 mixed-precision policy when 2 GPUs are
visible. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import run_hpcml, summary

from hpcml.data.sources.tokens import prepare_pystdlib

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = """
model: {{name: gpt-tiny, args: {{n_layer: 4, d_model: 256, n_head: 4}}}}
data: {{source: tokens, path: {corpus}, seq_len: 256, batch_size: 16, eval_windows: 8}}
train: {{max_steps: 20, eval_every: 0, log_every: 10, compile: {compile}}}
precision: bf16
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pystdlib")
    prepare_pystdlib(out, val_fraction=0.2, max_bytes=2_000_000)
    return out


def test_flash_attention_is_used_for_bf16_causal_attention() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if the flash kernel cannot run
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


@pytest.mark.parametrize("compile_on", [False, True])
def test_one_gpu_bf16_reports_mfu_and_peak_memory(
    corpus: Path, tmp_path: Path, compile_on: bool
) -> None:
    config = tmp_path / "gpt.yaml"
    config.write_text(CONFIG.format(corpus=corpus, compile=str(compile_on).lower()))
    run_hpcml("train", str(config), "--run-dir", str(tmp_path / "run"), "--quiet", timeout=600)
    s = summary(tmp_path / "run")
    assert s["device"]["type"] == "cuda"
    rank0 = s["memory"]["per_rank"][0]
    assert rank0["peak_allocated_bytes"] > 0
    # The run ends with an evaluation, whose peak is kept apart from the training steps'.
    assert rank0["eval_peak_allocated_bytes"] > 0
    thr = s["throughput"]
    assert thr["tokens_per_s"] > 0
    if thr["mfu"] is not None:  # known device in the peak table
        assert 0 < thr["mfu"] < 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_fsdp_bf16(corpus: Path, tmp_path: Path) -> None:
    config = tmp_path / "gpt.yaml"
    config.write_text(CONFIG.format(corpus=corpus, compile="false"))
    run_hpcml(
        "train",
        str(config),
        "parallel.strategy=zero3",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--quiet",
        timeout=600,
    )
    per_rank = summary(tmp_path / "run")["memory"]["per_rank"]
    assert len(per_rank) == 2 and all(r["peak_allocated_bytes"] > 0 for r in per_rank)
