"""The gpt model family: shapes, named sizes, FLOPs accounting, zoo integration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hpcml.config import load_config
from hpcml.errors import ModelError
from hpcml.models import gpt
from hpcml.models.zoo import build_model, complete_args, count_parameters, get_spec


def test_forward_shape_and_causality() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", {}).eval()
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    # Changing a later token must not change the predictions at earlier positions.
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    out = model(changed)
    # Masked positions add exact zeros through the same kernels: equal to rounding; a later
    # token's change moves the later logits by far more than 1e-6 (asserted next).
    assert torch.allclose(out[:, :10], logits[:, :10], atol=1e-6)
    assert not torch.allclose(out[:, 10:], logits[:, 10:], atol=1e-6)


@pytest.mark.parametrize("size", list(gpt.SIZES))
def test_named_sizes_parameter_count_matches_formula(size: str) -> None:
    with torch.device("meta"):
        model = build_model(size, {})
    assert count_parameters(model) == gpt.parameters(gpt.config_of(gpt.SIZES[size]))


def test_gpt2_small_is_124m_and_tied() -> None:
    with torch.device("meta"):
        model = build_model("gpt2-small", {"vocab_multiple": 1})
        padded = build_model("gpt2-small", {})
    assert count_parameters(model) == 124_439_808  # GPT-2 small with tied embeddings
    assert model.lm_head.weight is model.emb.tok.weight
    # The default pads the 50257-token table to 50304 rows (a multiple of 64), as nanoGPT does.
    assert count_parameters(padded) == 124_439_808 + (50304 - 50257) * 768


def test_padded_vocabulary_ids_never_win() -> None:
    torch.manual_seed(0)
    model = gpt.build_gpt(**dict(gpt.SIZES["gpt-tiny"], vocab_size=100))
    assert model.emb.tok.weight.shape[0] == 128 and model.lm_head.weight.shape[0] == 128
    with torch.no_grad():
        model.emb.tok.weight[100:] = 1e4  # tied head: padding rows would dominate every logit
    logits = model(torch.randint(0, 100, (2, 16)))
    assert logits.shape == (2, 16, 100)
    assert torch.isfinite(logits).all() and logits.abs().max() < 1e3


def test_untied_and_swiglu_variants() -> None:
    cfg = dict(gpt.SIZES["gpt-tiny"], tie_embeddings=False, mlp="swiglu")
    model = gpt.build_gpt(**cfg)
    assert model.lm_head.weight is not model.emb.tok.weight
    assert model.blocks[0].mlp.w3 is not None
    assert count_parameters(model) == gpt.parameters(gpt.config_of(cfg))
    assert model(torch.zeros((1, 8), dtype=torch.int64)).shape == (1, 8, 256)


def test_train_flops_per_token_matches_counted_flops() -> None:
    """6N + 12LHQT against torch's FlopCounterMode on a real forward (x3 for training)."""
    args = {"n_layer": 3, "d_model": 128, "n_head": 4, "max_seq_len": 128, "vocab_size": 512}
    # Meta tensors: SDPA decomposes into counted matmuls (CPU's fused kernel is not counted).
    with torch.device("meta"):
        model = gpt.build_gpt(**args)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.zeros((1, 128), dtype=torch.int64, device="meta"))
    counted = 3 * counter.get_total_flops() / 128
    formula = gpt.train_flops_per_token(gpt.config_of(args))
    # The formula also counts norm and bias parameters as matmul work: under 2% here.
    assert formula == pytest.approx(counted, rel=0.02)
    assert formula > 6 * (count_parameters(model) - 128 * 128)  # attention term is included


def test_zoo_completes_vocab_and_context_from_data() -> None:
    args = complete_args("gpt-tiny", {}, (32,), 300)
    assert args == {"vocab_size": 300, "max_seq_len": 32}
    assert complete_args("gpt-tiny", {"vocab_size": 512}, (32,), 300)["vocab_size"] == 512
    spec = get_spec("gpt2-small")
    assert spec.input_dtype == "int64" and spec.shape_for({}) == (1024,)
    assert spec.train_flops_per_token_fn is not None


def test_bad_arguments_are_model_errors() -> None:
    with pytest.raises(ModelError, match="n_heads"):
        gpt.build_gpt(n_heads=4)
    with pytest.raises(ModelError, match="not divisible"):
        gpt.build_gpt(d_model=65, n_head=4)


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[2] / "examples").glob("gpt*.yaml"))
)
def test_example_configs_are_valid(path: Path) -> None:
    cfg = load_config(path)
    assert get_spec(cfg.model.name).task == "language_modeling"
    assert cfg.data.source == "tokens"
