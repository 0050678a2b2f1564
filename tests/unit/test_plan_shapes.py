"""Model shapes and FLOPs against published figures: Megatron-LM, Korthikanti et al., PaLM,
released parameter counts, and the zoo itself (counted with torch)."""

from __future__ import annotations

import pytest

from hpcml.plan.common import PlanError
from hpcml.plan.shapes import (
    megatron_flops_per_iteration,
    megatron_params,
    mlp_shape,
    model_shape,
    palm_flops_per_token,
    shape_from_raw,
    transformer,
)

# Narayanan et al. 2021, Table 1: (parameters in billions, heads, hidden, layers), V = 51200,
# s = 2048.
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96), (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128),
]


@pytest.mark.parametrize("billions,heads,hidden,layers", MEGATRON_TABLE_1)
def test_megatron_parameter_counts(billions: float, heads: int, hidden: int, layers: int) -> None:
    # Table 1 prints one decimal of a billion: 0.05 plus the paper's own rounding.
    assert megatron_params(layers, hidden, 51200, 2048) / 1e9 == pytest.approx(billions, abs=0.06)
    # The block-by-block count is Eq. 2 plus the final LayerNorm (2h), which Eq. 2 leaves out.
    t = transformer("m", layers, hidden, heads, 2048, 51200)
    assert t.params - 2 * hidden == pytest.approx(megatron_params(layers, hidden, 51200, 2048),
                                                  rel=1e-9)


@pytest.mark.parametrize(
    "name,released",
    [("gpt2-small", 124_439_808), ("llama-7b", 6_738_415_616), ("llama-13b", 13_015_864_320),
     ("llama-70b", 68_976_648_192), ("llama3-8b", 8_030_261_248)],
)
def test_released_parameter_counts(name: str, released: int) -> None:
    # Hugging Face checkpoints' parameter counts (gpt2, Llama-2-*-hf, Meta-Llama-3-8B). The
    # zoo's gpt2-small pads its vocabulary to a multiple of 64; unpadded it is GPT-2's own.
    args = {"vocab_multiple": 1} if name == "gpt2-small" else None
    assert model_shape(name, args).params == released


def test_palm_540b_mfu() -> None:
    # PaLM (Chowdhery et al. 2022), Appendix B: 540B parameters, L=118, H=48, Q=256, T=2048,
    # 238.3K tokens/s on 6144 TPU v4 chips (275 TFLOP/s bf16) is 46.2% MFU.
    per_token = palm_flops_per_token(540.35e9, 118, 48 * 256, 2048)
    # 46.2% printed to 3 digits: half a unit of the last is 0.0005, doubled for the inputs.
    assert per_token * 238.3e3 / (6144 * 275e12) == pytest.approx(0.462, abs=0.001)


def test_palm_and_megatron_formulas_agree() -> None:
    # 72BLsh^2 (1 + s/(6h) + V/(12hL)) is 6N + 12LHQT per token for GPT blocks.
    t = transformer("gpt3", 96, 12288, 96, 2048, 51200)
    per_batch = megatron_flops_per_iteration(1, 2048, 96, 12288, 51200)
    assert t.model_flops_per_sample() == pytest.approx(per_batch, rel=0.002)


@pytest.mark.parametrize("layers,hidden,overhead", [(96, 12288, 0.027), (105, 20480, 0.016)])
def test_korthikanti_selective_recompute_overhead(layers: int, hidden: int,
                                                  overhead: float) -> None:
    # Korthikanti et al. 2022: selective recomputation costs 2.7% (GPT-3) and 1.6% (MT-NLG)
    # extra FLOPs (Eq. 8 over Eq. 7).
    sel = megatron_flops_per_iteration(1, 2048, layers, hidden, 51200, "attention-scores")
    none = megatron_flops_per_iteration(1, 2048, layers, hidden, 51200, "none")
    assert sel / none - 1 == pytest.approx(overhead, abs=0.001)


def test_full_recompute_is_four_thirds() -> None:
    # Narayanan et al. 2021, Eq. 3: 96 instead of 72 (one more forward pass).
    t = transformer("gpt3", 96, 12288, 96, 2048, 51200)
    ratio = t.hardware_flops_per_sample("full") / t.model_flops_per_sample()
    paper = (megatron_flops_per_iteration(1, 2048, 96, 12288, 51200, "full")
             / megatron_flops_per_iteration(1, 2048, 96, 12288, 51200))
    assert ratio == pytest.approx(paper, rel=0.01)
    assert 1 < t.hardware_flops_per_sample("attention-scores") / t.model_flops_per_sample() < 1.01


def test_generic_models_train_at_three_times_forward() -> None:
    m = model_shape("simple_cnn")
    assert m.model_flops_per_sample() == 3 * 83_240_960
    assert m.tokens_per_sample == 1


def test_mlp_shape_follows_arguments() -> None:
    m = mlp_shape({"hidden": 64, "depth": 3, "num_classes": 5, "input_shape": [1, 8, 8]})
    assert m.params == (64 * 64 + 64) + 2 * (64 * 64 + 64) + (64 * 5 + 5)
    assert m.forward_flops_per_sample == 2 * (64 * 64 * 3 + 64 * 5)


def test_unknown_models_and_raw_shapes() -> None:
    with pytest.raises(PlanError, match="not known"):
        model_shape("gpt-5")
    with pytest.raises(PlanError, match="default arguments"):
        model_shape("resnet18", {"num_classes": 100})
    raw = shape_from_raw(params=7_000_000_000)
    assert raw.kind == "generic" and raw.params == 7_000_000_000
    t = shape_from_raw(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000)
    assert t.is_transformer and t.params > 6e9
    with pytest.raises(PlanError, match="not divisible"):
        shape_from_raw(layers=2, hidden=100, heads=3)
    assert model_shape("gpt2-small", seq=2048).seq == 2048


def test_zoo_table_matches_torch() -> None:
    """The planner's CNN numbers equal what torch counts on the zoo models."""
    torch = pytest.importorskip("torch")
    from hpcml.models.zoo import build_model, count_parameters, forward_flops_per_sample, get_spec

    def saved_bytes(model: torch.nn.Module, shape: tuple[int, ...], b: int) -> int:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(torch.randn(b, *shape))
            torch.nn.functional.cross_entropy(out, torch.zeros(b, dtype=torch.long))
        return sum(seen.values())

    for name in ("simple_cnn", "resnet18", "mlp"):
        model = build_model(name, {})
        shape = get_spec(name).shape_for({})
        planned = model_shape(name)
        assert planned.params == count_parameters(model), name
        assert planned.forward_flops_per_sample == forward_flops_per_sample(model, shape), name
        assert planned.param_tensors == len(list(model.parameters())), name
        per_sample = (saved_bytes(model, shape, 4) - saved_bytes(model, shape, 2)) / 2
        assert planned.activation_bytes_per_sample == per_sample, name
