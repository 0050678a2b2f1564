"""int8 weights for a frozen fine-tuning base (QLoRA-style, `finetune.base_dtype: int8`).

torchao's weight-only int8 (`Int8WeightOnlyConfig`: int8 weights with one scale per output
row, activations left in float; the same scheme `hpcml serve`'s `generation.quantize: int8`
uses) on every Linear of the base whose weight no other module shares (a gpt's lm_head is tied
to the token embedding and stays float). PEFT recognises torchao's tensors and wraps those
Linears in its `TorchaoLoraLinear`, so the adapters train in fp32 beside the int8 weights;
the weights stay frozen parameters, so checkpoints (which keep trainable tensors only) are
unchanged. `dequantize_state` turns a state dict holding them back into fp32 tensors, which is
what the merged export is made from: the weights the run trained on, not the original fp32
base.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from hpcml.errors import ConfigError


def _quantize_api() -> tuple[Any, Any]:
    # At import torchao logs the GPU kernels a CPU build cannot load, and torch a note on one
    # of torchao's enums: not news for whoever trains.
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ConfigError(
            "finetune.base_dtype: int8 needs torchao; install it with pip install torchao (it "
            "uses the torch already installed), or set finetune.base_dtype: fp32."
        ) from None
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return Int8WeightOnlyConfig, quantize_


def untied_linears(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear`s whose weight belongs to no other module."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        n for n, m in model.named_modules() if type(m) is nn.Linear and owners[id(m.weight)] == 1
    ]


def quantize_base(model: nn.Module) -> list[str]:
    """Put int8 weights in the untied Linears of `model` (in place); returns their names."""
    config, quantize_ = _quantize_api()
    names = set(untied_linears(model))
    quantize_(model, config(), filter_fn=lambda _m, fqn: fqn in names)
    for p in model.parameters():
        p.requires_grad_(False)  # the base is frozen; adapters come after
    return sorted(names)


def is_quantized(t: torch.Tensor) -> bool:
    """A torchao tensor (int8 data and scales behind a float tensor's face)."""
    return type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "qdata")


def dequantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every torchao tensor replaced by its fp32 value (the others as they are)."""
    return {k: v.dequantize().float() if is_quantized(v) else v for k, v in state.items()}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as stored: an int8 tensor's data plus its scales."""
    total = 0
    for p in model.parameters():
        parts = [getattr(p, n) for n in ("qdata", "scale") if hasattr(p, n)] or [p]
        total += sum(t.numel() * t.element_size() for t in parts)
    return total
