"""`hpcml.models.quant`: torchao's int8 weights in a QLoRA-style frozen base."""

from __future__ import annotations

import torch
from torch import nn

from hpcml.models import quant


def test_untied_linears_get_int8_weights_and_dequantize_to_fp32_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
    model[1].weight.data[3] *= 100  # one row 100x larger: a per-tensor scale would flatten others
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    tied = nn.Linear(8, 10, bias=False)
    tied.weight = model[0].weight  # tied like a gpt's lm_head to its token embedding
    model.append(tied)
    assert quant.quantize_base(model) == ["1", "3"]
    assert quant.is_quantized(model[1].weight) and not quant.is_quantized(model[4].weight)
    assert all(not p.requires_grad for p in model.parameters())
    state = quant.dequantize_state(model.state_dict())
    assert sorted(state) == sorted([*fp32, "4.weight"])
    for key in ("1.weight", "3.weight"):
        w, got = fp32[key], state[key]
        assert type(got) is torch.Tensor and got.dtype == torch.float32
        # Symmetric rounding to a step of the row's absmax / 127 (torchao's int8 scheme): at
        # most half a step off, plus fp32 rounding of the scale.
        step = w.abs().amax(dim=1, keepdim=True) / 127
        assert torch.all((got - w).abs() <= step / 2 * 1.001)
    # int8 data (1 byte) + one fp32 scale and one int8 zero point (held, though 0 in this
    # symmetric scheme) per row, instead of 4 bytes per weight; biases and the embedding
    # (shared with the tied head) stay fp32.
    linear_bytes = (16 * 8 + 10 * 16) * 1 + (16 + 10) * (4 + 1)
    float_bytes = (16 + 10) * 4 + 10 * 8 * 4
    assert quant.weight_bytes(model) == linear_bytes + float_bytes
