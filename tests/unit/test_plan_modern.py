"""The planner on modern stacks: fused attention, GQA, SwiGLU, fp32 gradients, offload of
gradients, ZeRO-3 with a parameter count only, the CUDA reserve, catalog overrides and one
goodput function, each against a published figure or an independent count."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpcml.plan.common import PlanError
from hpcml.plan.cost import checkpoint_plan, daly_interval, spot_economics
from hpcml.plan.hardware import load_catalog
from hpcml.plan.memory import Layout, Training, activation_bytes_per_layer, per_device_bytes
from hpcml.plan.shapes import model_shape, shape_from_raw, transformer
from hpcml.train.fault.guard import checkpoint_advice


def test_gpt2_small_with_sdpa_is_the_measured_817_mb() -> None:
    # Issue 12: saved activations of the zoo's gpt2-small at seq 1024, batch 1, fp32, measured
    # with saved-tensor hooks: 817 MB (the score term made the old prediction 2,195 MB).
    m = model_shape("gpt2-small")
    assert m.attention == "sdpa"
    mem = per_device_bytes(m, Layout(), Training("fp32"), 1)
    assert mem.activations_bytes == pytest.approx(817e6, rel=0.01)
    eager = per_device_bytes(m, Layout(attention="eager"), Training("fp32"), 1)
    # Without dropout eager attention adds the softmax output, a*s^2 fp32 per layer.
    extra = 12 * 12 * 1024 * 1024 * 4 - 12 * 4 * 12 * 1024  # less sdpa's log-sum-exp
    assert eager.activations_bytes - mem.activations_bytes == pytest.approx(extra)


def test_korthikanti_with_and_without_flash() -> None:
    # Korthikanti et al. 2022, Table 2 (16-bit, dropout): sbh(34 + 5as/h) per layer without
    # recomputation; selective recomputation and FlashAttention both leave sbh*34.
    s, b, h, a = 2048, 1, 12288, 96
    eager = activation_bytes_per_layer(s, b, h, a, attention="eager")
    assert eager == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    flash = activation_bytes_per_layer(s, b, h, a, attention="flash")
    assert flash == pytest.approx(s * b * h * 34 + 4 * s * b * a)  # + fp32 log-sum-exp
    selective = activation_bytes_per_layer(s, b, h, a, recompute="attention-scores", attention="eager")
    assert selective == pytest.approx(s * b * h * 34)


def test_gqa_narrows_k_and_v() -> None:
    s, b, h, a = 4096, 1, 8192, 64
    full = activation_bytes_per_layer(s, b, h, a, attention="flash", dropout=False)
    gqa = activation_bytes_per_layer(s, b, h, a, attention="flash", dropout=False, kv_heads=8)
    # K and V are 2 bytes each per element at width h * kv/a instead of h.
    assert full - gqa == pytest.approx(s * b * h * 4 * (1 - 8 / 64))


def test_swiglu_keeps_four_ffn_wide_tensors() -> None:
    s, b, h, a, f = 1024, 1, 4096, 32, 11008
    gelu = activation_bytes_per_layer(s, b, h, a, attention="flash", ffn_hidden=f)
    gated = activation_bytes_per_layer(s, b, h, a, attention="flash", ffn_hidden=f, gated_mlp=True)
    assert gated - gelu == pytest.approx(s * b * f * 2 * 2)  # two more 16-bit ffn tensors
    raw = shape_from_raw(
        layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn_hidden=11008, swiglu=True
    )
    assert raw.params == model_shape("llama-7b").params == 6_738_415_616


def test_fp32_gradients_as_megatron_and_fsdp2_keep_them() -> None:
    # Megatron-LM's distributed-optimizer guide: bf16 params with fp32 grads take 18 bytes per
    # parameter without sharding (2 + 4 + 12) and 6 + 12/d with its distributed optimizer.
    m = model_shape("llama-7b")
    tr = Training("bf16", grad_dtype="fp32")
    plain = per_device_bytes(m, Layout(), tr, 8)
    assert plain.model_states_bytes / m.params == pytest.approx(18, rel=1e-3)
    dist = per_device_bytes(m, Layout(zero=1), tr, 8)
    assert dist.model_states_bytes / m.params == pytest.approx(6 + 12 / 8, rel=1e-3)
    with pytest.raises(PlanError, match="grad-dtype"):
        Training("bf16", grad_dtype="int8")


def test_offload_takes_the_gradient_shard_along() -> None:
    m = model_shape("llama-7b")
    base = per_device_bytes(m, Layout(zero=2), Training(), 64)
    off = per_device_bytes(m, Layout(zero=2, offload="optimizer"), Training(), 64)
    assert off.grads_bytes == 0 and off.optimizer_bytes == 0
    assert off.params_bytes == base.params_bytes == 2 * m.params
    z1 = per_device_bytes(m, Layout(zero=1, offload="optimizer"), Training(), 64)
    assert z1.grads_bytes == 2 * m.params  # the whole gradient is all-reduced on the device


def test_params_only_under_zero3_needs_the_largest_layer() -> None:
    raw = shape_from_raw(params=7_000_000_000)
    with pytest.raises(PlanError, match="--largest-layer"):
        per_device_bytes(raw, Layout(zero=3), Training(), 64)
    given = shape_from_raw(params=7_000_000_000, largest_layer=2e8)
    z3 = per_device_bytes(given, Layout(zero=3), Training(), 64)
    z2 = per_device_bytes(given, Layout(zero=2), Training(), 64)
    assert z3.total_bytes < z2.total_bytes  # issue 12: it used to be 30.2 GB against 16.0 GB
    assert z3.buffers_bytes == 2 * 2e8 * 2  # the gathered and the prefetched layer, bf16
    off = per_device_bytes(given, Layout(zero=3, offload="params"), Training(), 64)
    assert off.total_bytes == off.buffers_bytes  # only the gathered layers stay on the device


def test_cuda_reserve_decides_a_tight_fit() -> None:
    m = transformer("t", 4, 1024, 16, 1024, 1000)
    mem = per_device_bytes(m, Layout(), Training(), 1, device_memory_bytes=10**9)
    cap = mem.total_bytes / 0.9 + 0.5e9  # fits without a reserve, not with 1 GB
    mem = per_device_bytes(m, Layout(), Training(), 1, device_memory_bytes=int(cap))
    assert mem.fits(reserve_bytes=0.0)
    assert not mem.fits()
    assert mem.fits(reserve_bytes=0.4e9)


def test_catalog_override_of_one_field_keeps_the_others(tmp_path: Path) -> None:
    extra = tmp_path / "mine.yaml"
    extra.write_text("accelerators:\n  h100-sxm:\n    peak_flops: {bf16: 500e12}\n")
    shipped = load_catalog().accelerator("h100-sxm")
    mine = load_catalog([extra]).accelerator("h100-sxm")
    assert mine.peak("bf16") == 500e12
    assert mine.peak("fp8") == shipped.peak("fp8")
    assert mine.memory_bytes == shipped.memory_bytes
    m = model_shape("llama-70b")
    mem = per_device_bytes(m, Layout(micro_batch=1), Training(), 1, mine.memory_bytes)
    assert not mem.fits()


def test_one_goodput_for_spot_and_checkpoint_advice() -> None:
    # Daly 2006's case: checkpoint 5 min, MTBF 15 min, no restart time.
    c, m = 300.0, 900.0
    tau = daly_interval(c, m)
    # Daly's expected wall time per unit of work, T_w/T_s = M (e^{(tau+c)/M} - 1) / tau.
    expected = tau / (m * math.expm1((tau + c) / m))
    advice = checkpoint_advice(c, m, 0.0)
    spot = spot_economics(
        10.0,
        0.6,
        preemptions_per_instance_hour=3600 / m,
        instances=1,
        checkpoint_s=c,
        restart_s=0.0,
    )
    assert advice["expected_goodput"] == pytest.approx(expected)
    assert spot.spot_goodput == pytest.approx(expected)
    assert checkpoint_plan(c, math.inf).goodput == 1.0
