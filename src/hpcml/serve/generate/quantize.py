"""Int8 weights for text generation (`generation.quantize: int8` in the serve config).

torchao's weight-only int8 (`Int8WeightOnlyConfig`: per-output-channel scales, activations
stay in the model's dtype) on every `nn.Linear` of the gpt, the attention and MLP projections
and the output head. Weight-only keeps a request's tokens independent of the batch it was
decoded in: dynamic activation quantization (torch.ao's `quantize_dynamic`, deprecated upstream)
takes one activation scale over the whole batch, so continuous batching would change what a
request generates. The embedding table stays in float (a lookup, not a matmul).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from hpcml.errors import ConfigError


def quantize_int8(model: nn.Module) -> nn.Module:
    """`model` with int8 weights in place of its Linear layers' float ones (in place)."""
    try:
        # At import torchao logs the GPU kernels a CPU build cannot load, and torch a note on
        # one of torchao's enums: not news for whoever serves.
        quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        finally:
            for q, level in zip(quiet, levels, strict=True):
                q.setLevel(level)
    except ImportError:
        raise ConfigError(
            "generation.quantize: int8 needs torchao; install it with pip install torchao (it "
            "uses the torch already installed), or set generation.quantize: none."
        ) from None
    if getattr(model, "lm_head", None) is not None:
        head: Any = model.lm_head
        tied = getattr(model, "emb", None)
        if tied is not None and head.weight is tied.tok.weight:
            # Untie first: the int8 head must not replace the float embedding table.
            head.weight = nn.Parameter(head.weight.detach().clone())
    quantize_(model, Int8WeightOnlyConfig())
    return model


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the Linear layers' weights as stored (int8 data plus scales after quantizing)."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            w: Any = m.weight
            parts = [getattr(w, n) for n in ("qdata", "scale") if hasattr(w, n)] or [w]
            total += sum(p.numel() * p.element_size() for p in parts)
    return total
