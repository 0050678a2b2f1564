"""Parallelism for the `gpt` family (torchtitan's parallelize.py pattern): named functions that
know the model's layout (`emb.tok`, `blocks[i].attn.wq`, `lm_head` ...), kept apart from the
model code. Order: tensor parallel, activation checkpointing, compile, FSDP.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019): q/k/v and the first MLP layer
are split column-wise (by heads / hidden units), the output projections row-wise, so each
block needs one all-reduce in forward per sublayer. With sequence parallelism the norms and
dropouts work on a slice of the sequence and the all-reduces become reduce-scatter +
all-gather (Korthikanti et al. 2022).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpcml.errors import ConfigError


def check_tp(model: nn.Module, tp: int) -> None:
    cfg: Any = model.cfg  # type: ignore[assignment]
    for what, n in (("n_head", cfg.n_head), ("MLP hidden size", cfg.mlp_hidden)):
        if n % tp:
            raise ConfigError(
                f"parallel.tp {tp} does not divide the model's {what} ({n}); choose a tp that "
                "divides the number of attention heads and the MLP width."
            )


def padded_vocab_mask(model: nn.Module, tp_mesh: DeviceMesh) -> DTensor | None:
    """Loss-parallel logits keep the head's padded columns (`vocab_multiple`): cutting them
    off a vocabulary-sharded DTensor would gather it. This mask (0 on the vocabulary, -inf on
    the padding), sharded like the logits, gives them no probability and no gradient; None
    when nothing is padded. Each rank builds its own slice: no communication."""
    cfg: Any = model.cfg  # type: ignore[assignment]
    if cfg.padded_vocab == cfg.vocab_size:
        return None
    mask = torch.zeros(cfg.padded_vocab, device=tp_mesh.device_type)
    mask[cfg.vocab_size :] = float("-inf")
    return distribute_tensor(mask, tp_mesh, [Shard(0)], src_data_rank=None)


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool = False
) -> None:
    """Shard every block's attention and MLP, the token embedding (by vocabulary rows) and the
    output head (by vocabulary columns) over `tp_mesh`. With `loss_parallel` the logits stay
    sharded by vocabulary (a DTensor, Shard(-1)) for `torch.distributed.tensor.parallel.
    loss_parallel`'s cross-entropy, so no rank gathers the (B, T, vocab) logits; otherwise they
    come out whole on every rank. Sets `model.loss_parallel` to say which."""
    check_tp(model, tp_mesh.size())
    # A pipeline stage (hpcml.distributed.pipeline.GPTStage) holds the embeddings, the final
    # norm and the head only where they are its own (None elsewhere), and its blocks in a
    # ModuleDict keyed by their index in the whole model.
    emb: Any = getattr(model, "emb", None)
    head: Any = getattr(model, "lm_head", None)
    tied = emb is not None and head is not None and head.weight is emb.tok.weight
    seq = Shard(1)
    residual = seq if sequence_parallel else Replicate()
    head_plan = (
        ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
    )
    model.loss_parallel = loss_parallel  # type: ignore[assignment]
    if loss_parallel:
        model.vocab_mask = padded_vocab_mask(model, tp_mesh)  # type: ignore[assignment]
    top: dict[str, Any] = {}
    if emb is not None:
        top["emb.tok"] = RowwiseParallel(input_layouts=Replicate())
    if head is not None:
        top["lm_head"] = head_plan
    if sequence_parallel:
        # Positions are added to the whole sequence, then each rank keeps its slice (no comm).
        if emb is not None:
            top["emb"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=True
            )
        if getattr(model, "norm", None) is not None:
            top["norm"] = SequenceParallel()
    if top:
        parallelize_module(model, tp_mesh, top)
    blocks: Any = model.blocks
    block: Any
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        plan: dict[str, Any] = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=residual),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=residual),
        }
        if block.mlp.w3 is not None:
            plan["mlp.w3"] = ColwiseParallel()
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan.update(
                {
                    "attn_norm": SequenceParallel(),
                    "attn": gather,
                    "mlp_norm": SequenceParallel(),
                    "mlp": PrepareModuleInput(
                        input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(block, tp_mesh, plan)
    if tied:
        # Both are vocabulary-row shards (Shard(0)) on the same mesh: share one parameter again.
        head.weight = emb.tok.weight
