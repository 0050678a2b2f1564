"""`hpcml.models.quant` with `nf4`: torchao's NF4Tensor (QLoRA's 4-bit NormalFloat) in a frozen
fine-tuning base."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcml.models import quant

# QLoRA's 16 NormalFloat levels (Dettmers et al. 2023, appendix E); the widest gap is -1 to -0.6962.
LEVELS = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
          0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]  # fmt: skip
HALF_GAP = (1.0 - 0.6962) / 2


def test_untied_linears_of_64_weight_blocks_get_nf4_within_half_a_level() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 32), nn.Linear(32, 7))
    model[1].weight.data[5] *= 50  # one row 50x larger: a scale per 64 weights keeps the others
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    tied = nn.Linear(64, 10, bias=False)
    tied.weight = model[0].weight  # tied like a gpt's lm_head to its token embedding
    model.append(tied)
    # 7 x 32 = 224 weights are not a multiple of 64: that Linear stays fp32, as does the head.
    assert quant.quantize_base(model, "nf4") == ["1"]
    assert quant.is_quantized(model[1].weight) and not quant.is_quantized(model[2].weight)
    assert all(not p.requires_grad for p in model.parameters())
    got = quant.dequantize_state(model.state_dict())["1.weight"]
    assert type(got) is torch.Tensor and got.dtype == torch.float32
    w = fp32["1.weight"]
    blocks = w.reshape(-1, 64)  # 32 blocks of 64 weights (one row = 2 blocks)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    err = (got.reshape(-1, 64) - blocks).abs()
    # Each weight goes to the level nearest its value / block absmax: at most half the widest
    # gap, times the absmax. The absmax is itself stored as int8 (double quantization): its
    # deviation from the mean of all absmaxes, over the largest deviation of its group of 4
    # blocks (32 blocks: groups of 4 leave 8), off by at most one step (max deviation / 128,
    # the top one clamped from 128 to 127). So the outlier row coarsens its own group only.
    dev = (absmax - absmax.mean()).abs().reshape(8, 4).amax(dim=1).repeat_interleave(4)
    bound = HALF_GAP * absmax + dev.unsqueeze(1) / 128
    assert torch.all(err <= bound * 1.001)
    assert err.max() > HALF_GAP * 0.9 * absmax.max()  # not looser: the outlier's block is near it
    # Every dequantized weight is a level times its block's (dequantized) absmax.
    scale = got.reshape(-1, 64).abs().amax(dim=1, keepdim=True)
    levels = torch.tensor(LEVELS)
    ratio = got.reshape(-1, 64) / scale
    assert torch.allclose((ratio.unsqueeze(-1) - levels).abs().amin(-1), torch.zeros(1), atol=1e-6)
    # 2048 weights: 1024 bytes of 4-bit codes, 32 int8 absmaxes, 8 fp32 factors (32 blocks
    # have 8 groups of 4 so a weight has >= 8 of them), the fp32 mean and 16 fp32 levels;
    # everything else fp32 (embedding shared with the head, bias, the 224-weight Linear).
    nf4 = 2048 // 2 + 32 + 8 * 4 + 4 + 16 * 4
    floats = (10 * 64 + 32 + 7 * 32 + 7) * 4
    assert quant.weight_bytes(model) == nf4 + floats


@pytest.mark.parametrize(
    ("numel", "want"),
    [(768 * 768, (9216, 256)), (64 * 64, (64, 8)), (2048, (32, 4)), (64 * 3, (3, 1))],
)
def test_nf4_groups_of_absmaxes(numel: int, want: tuple[int, int]) -> None:
    """QLoRA's 256 absmaxes per factor where a weight has enough blocks (GPT-2's 768 x 768),
    else the largest power of two leaving >= 8 factors (1 for an odd block count)."""
    assert quant.nf4_blocks(numel) == want


def test_nf4_unshardable_names_the_weight_ranks_do_not_divide() -> None:
    """FSDP splits an nf4 weight's rows and each of its parts into equal shards."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 192))
    # 64 x 64: 64 blocks in 8 groups; 192 x 64: 192 blocks in 12 groups of 16.
    assert quant.nf4_unshardable(model, 2) is None
    assert quant.nf4_unshardable(model, 4) is None
    assert quant.nf4_unshardable(model, 8) == "1.weight (192 rows, 12 scales)"
    assert quant.nf4_unshardable(model, 3) == "0.weight (64 rows, 8 scales)"
