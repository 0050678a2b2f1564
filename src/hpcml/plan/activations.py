"""Bytes a transformer block keeps for backward, and the micro-batches a pipeline stage holds:
the formulas of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), extended to fused attention, GQA and gated MLPs. `plan.memory` adds the
output layer and pipeline bookkeeping on top.
"""

from __future__ import annotations

from typing import Any

from hpcml.plan.recompute import op_saved_width


def activation_bytes_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    dropout: bool = True,
    ffn_hidden: int | None = None,
    gated_mlp: bool = False,
    kv_heads: int | None = None,
    attention: str = "eager",
    sp_saves_gathered: bool = False,
) -> float:
    """Bytes one transformer block keeps for its backward pass.

    Korthikanti et al. 2022, Sec. 4.1 and Table 2, for 16-bit activations and 1-byte dropout
    masks:  none: sbh(34 + 5as/h);  TP: sbh(10 + 24/t + 5as/(ht));  TP+SP: sbh/t (34 + 5as/h);
    recomputing the attention scores (`attention-scores`, their "selective") drops the 5as/h
    term; `op` keeps what torchtitan's op policy saves; full recomputation keeps
    only the block input, 2sbh (sharded by t under SP, as Megatron-LM stores it).
    Of the 34: 24 are sharded by TP (Q, K, V 2 + 2 + 2, the projection input 2, and the MLP's
    8 + 8 for a 4h GELU MLP), 10 are not (two LayerNorm inputs 4, attention and MLP inputs
    2 + 2, two dropout masks 1 + 1). Other element sizes scale the 16-bit terms; with grouped
    queries (GQA, kv_heads < heads) K and V are kv_heads/heads as wide; a gated MLP (SwiGLU)
    keeps four ffn-wide tensors (both projections, the SiLU output and the product) instead
    of two. Fused attention (sdpa, flash) never keeps the s x s scores, the same saving as
    recomputing them, and keeps a 4-byte log-sum-exp per head and row instead.
    """
    s, b, h, a, t = float(seq), float(micro_batch), float(hidden), float(heads), float(tp)
    kv = float(kv_heads or heads)
    sbh = s * b * h
    half = act_bytes / 2.0
    mask = 1.0 if dropout else 0.0
    if recompute == "full":
        kept = 2.0 * half * sbh
        return kept / t if sp else kept
    ffn = float(ffn_hidden or 4 * hidden)
    if recompute == "op":
        # torchtitan's op policy: the block input, the attention kernel's output and
        # log-sum-exp, and every other matmul output (hpcml.plan.recompute); the matmul outputs
        # and the kernel's are column-sharded under TP, the input only under SP.
        saved = op_saved_width(int(h), int(h * kv / a), int(ffn), gated_mlp)
        kept = 2.0 * half * sbh / (t if sp else 1.0)
        kept += 2.0 * half * s * b * (h + saved) / t + 4.0 * s * b * a / t
        return kept
    mlp_inner = (4.0 if gated_mlp else 2.0) * 2.0 * ffn / h  # 16 for a 4h GELU MLP
    qkv_out = 2.0 + 4.0 * kv / a + 2.0  # Q, K, V and the attention output (8 without GQA)
    sharded = (qkv_out + mlp_inner) * half
    replicated = 8.0 * half + 2.0 * mask
    per = sbh * (sharded / t + (replicated / t if sp else replicated))
    if sp and sp_saves_gathered:
        per += sbh * 4.0 * half * (1.0 - 1.0 / t)  # attention and MLP inputs kept whole
    if attention == "eager" and recompute == "none":
        # Softmax output and its dropout output (2 + 2 bytes) plus the dropout mask (1 byte),
        # for each of a heads' s x s score matrices; without dropout only the softmax output.
        score = ((4.0 if dropout else 2.0) * half + mask) * a * s / h
        per += sbh * score / t
    elif attention != "eager":
        per += 4.0 * s * b * a / t  # the fused kernel's fp32 log-sum-exp, one per row and head
    return per


def inflight_microbatches(pp: int, micro_batches: int, schedule: str, virtual: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    1F1B: min(p, m) (Narayanan et al. 2021, Sec. 2.2.1). Interleaved: times
    (1 + (p - 1)/(p v)) (Korthikanti et al. 2022, Sec. 4.2.3).
    """
    if pp == 1:
        return 1.0
    n = float(min(pp, micro_batches))
    if schedule == "interleaved" and virtual > 1:
        n *= 1.0 + (pp - 1) / (pp * virtual)
    return n


def output_grad_bytes(model: Any, micro_batch: int, tp: int, vocab_parallel: bool) -> float:
    """The output's gradient that backward's first op allocates while every activation is
    still alive: for a transformer the cross-entropy's fp32 gradient of the logits (whole on
    each rank without a vocabulary-parallel loss); small beside the activations otherwise."""
    if not model.is_transformer:
        return 0.0
    sbv = float(model.seq) * micro_batch * model.vocab
    return 4.0 * sbv / (tp if vocab_parallel else 1)
