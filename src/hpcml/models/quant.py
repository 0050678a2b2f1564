"""Quantized weights for a frozen fine-tuning base (QLoRA-style, `finetune.base_dtype`).

`int8`: torchao's weight-only int8 (`Int8WeightOnlyConfig`: int8 weights with one scale per output
row, activations left in float; the same scheme `hpcml serve`'s `generation.quantize: int8`
uses) on every Linear of the base whose weight no other module shares (a gpt's lm_head is tied
to the token embedding and stays float). PEFT recognises torchao's tensors and wraps those
Linears in its `TorchaoLoraLinear`, so the adapters train in fp32 beside the int8 weights;
the weights stay frozen parameters, so checkpoints (which keep trainable tensors only) are
unchanged. `dequantize_state` turns a state dict holding them back into fp32 tensors, which is
what the merged export is made from: the weights the run trained on, not the original fp32
base.

`nf4`: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023) by torchao's `NF4Tensor` (plain
PyTorch ops, so it runs on a CPU): 16 levels at the quantiles of a normal distribution, one
absmax per block of 64 weights, those absmaxes themselves quantized to int8 per block of 256
(double quantization; fewer when a weight has fewer blocks: the largest power of two dividing
its block count). The weight stays a frozen parameter whose forward dequantizes it (torchao's
`linear_nf4`), and PEFT gives those Linears its plain LoRA layer. A Linear whose weight count
is not a multiple of 64 stays fp32.
"""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import torch
from torch import nn

from hpcml.errors import ConfigError

NF4_BLOCK = 64  # weights per absmax (QLoRA's block size)
NF4_SCALER_BLOCK = 256  # absmaxes per int8 scale of the double quantization


def _quantize_api() -> tuple[Any, Any, Any]:
    # At import torchao logs the GPU kernels a CPU build cannot load, and torch a note on one
    # of torchao's enums: not news for whoever trains.
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4
    except ImportError:
        raise ConfigError(
            "finetune.base_dtype int8 and nf4 need torchao; install it with pip install torchao (it "
            "uses the torch already installed), or set finetune.base_dtype: fp32."
        ) from None
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return Int8WeightOnlyConfig, quantize_, to_nf4


def untied_linears(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear`s whose weight belongs to no other module."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        n for n, m in model.named_modules() if type(m) is nn.Linear and owners[id(m.weight)] == 1
    ]


def nf4_blocks(numel: int) -> tuple[int, int]:
    """(blocks of 64 weights, absmaxes per double-quantization scale) of an nf4 weight: 256
    absmaxes a scale as in QLoRA, fewer (a power of two) where the weight has too few blocks
    for that, so that every weight has at least 8 scales and its rows can be sharded over
    2, 4 or 8 ranks (FSDP splits each part of an nf4 tensor along with its rows)."""
    blocks = numel // NF4_BLOCK
    scaler_block = math.gcd(blocks, NF4_SCALER_BLOCK)
    while scaler_block > 1 and blocks // scaler_block < 8:
        scaler_block //= 2
    return blocks, scaler_block


def _weight(model: nn.Module, name: str) -> torch.Tensor:
    return cast(torch.Tensor, model.get_submodule(name).weight)


def nf4_linears(model: nn.Module) -> list[str]:
    """The untied Linears `base_dtype: nf4` quantizes: those of a multiple of 64 weights."""
    return [n for n in untied_linears(model) if _weight(model, n).numel() % NF4_BLOCK == 0]


def nf4_unshardable(model: nn.Module, ranks: int) -> str | None:
    """The first nf4 weight whose rows or scales `ranks` do not divide (FSDP cannot shard it),
    described; None when every one can be sharded. `model` may live on the meta device."""
    for n in nf4_linears(model):
        w = _weight(model, n)
        blocks, scaler_block = nf4_blocks(w.numel())
        scales = blocks // scaler_block
        if w.shape[0] % ranks or scales % ranks:
            return f"{n}.weight ({w.shape[0]} rows, {scales} scales)"
    return None


def quantize_base(model: nn.Module, dtype: str = "int8") -> list[str]:
    """Put `dtype` (int8 or nf4) weights in the untied Linears of `model` (in place); returns
    the names of the Linears quantized."""
    config, quantize_, to_nf4 = _quantize_api()
    names = set(untied_linears(model))
    if dtype == "int8":
        quantize_(model, config(), filter_fn=lambda _m, fqn: fqn in names)
    else:
        names = set(nf4_linears(model))
        for n in names:
            weight = _weight(model, n)
            _, scaler_block = nf4_blocks(weight.numel())
            w = to_nf4(weight.detach().float().contiguous(), NF4_BLOCK, scaler_block)
            model.get_submodule(n).weight = nn.Parameter(w, requires_grad=False)
    for p in model.parameters():
        p.requires_grad_(False)  # the base is frozen; adapters come after
    return sorted(names)


def is_quantized(t: torch.Tensor) -> bool:
    """A torchao tensor (int8 or nf4 data and scales behind a float tensor's face)."""
    return type(t) not in (torch.Tensor, nn.Parameter) and (
        hasattr(t, "qdata") or hasattr(t, "quantized_data")
    )


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a torchao tensor (int8: data x scale; nf4: levels x block absmax)."""
    if hasattr(t, "quantized_data"):  # NF4Tensor's `dequantize` is a static lookup helper
        return t.get_original_weight().float()  # type: ignore[attr-defined]
    return t.dequantize().float()  # type: ignore[no-any-return]


def dequantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every torchao tensor replaced by its fp32 value (the others as they are)."""
    return {k: dequantize(v) if is_quantized(v) else v for k, v in state.items()}


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes that hold `t`: a torchao tensor's data, scales and zero points (nf4: also its
    level table and scale mean); an FSDP-sharded one's shard times the shards (nf4 shards
    evenly); a plain tensor's elements."""
    local = getattr(t, "_local_tensor", None)
    if local is not None and is_quantized(local):
        return stored_bytes(local) * t.device_mesh.size()  # type: ignore[attr-defined]
    if not is_quantized(t):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return sum(stored_bytes(getattr(t, n)) for n in names)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as stored (quantized ones as their parts)."""
    return sum(stored_bytes(p) for p in model.parameters())
