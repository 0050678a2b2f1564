"""A decoder-only transformer (GPT) in one readable file, after nanoGPT.

Pre-norm blocks, causal attention through `scaled_dot_product_attention` (FlashAttention on
GPUs), GELU or SwiGLU MLP, learned positions, optionally tied input/output embeddings. The
layout (`blocks[i].attn.wq` ...) is what `hpcml.distributed.parallelize_gpt` shards; the model itself
knows nothing about parallelism. Input (B, T) int64 token ids; output (B, T, vocab) logits.

For generation (`hpcml.serve.generate`) `forward` also takes the tokens' positions and a KV
cache: any object with `attend(layer, q, k, v) -> y` (shapes (B, heads, T, head_dim)), which
stores the new keys and values and attends over everything cached before them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    max_seq_len: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    vocab_multiple: int = 64
    """Token table and output head get `padded_vocab` rows: a multiple of this (matmul kernels
    and tensor-parallel splits want round sizes). Logits of the padding ids are cut off, or,
    under loss-parallel tensor parallelism, kept at -inf (`vocab_mask`)."""

    @property
    def padded_vocab(self) -> int:
        return self.vocab_multiple * math.ceil(self.vocab_size / self.vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        hidden = int(self.mlp_ratio * self.d_model)
        if self.mlp == "swiglu":
            # Two input projections instead of one: 2/3 of the width keeps the parameter count
            # of the GELU MLP (Shazeer 2020); round up to a multiple of 64 for kernels.
            hidden = 64 * math.ceil(2 * hidden / 3 / 64)
        return hidden


SIZES: dict[str, dict[str, Any]] = {
    # CPU tests: a few hundred thousand parameters, byte vocabulary.
    "gpt-tiny": dict(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64),
    # GPT-2 small / medium and GPT-3 XL shapes (Radford et al. 2019; Brown et al. 2020).
    "gpt2-small": dict(vocab_size=50257, max_seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt-350m": dict(vocab_size=50257, max_seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt-1.3b": dict(vocab_size=50257, max_seq_len=2048, n_layer=24, n_head=16, d_model=2048),
}


class KVCache(Protocol):
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        # Separate q/k/v projections (not one fused qkv) so column-wise tensor parallelism
        # splits each by heads.
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            y = cache.attend(layer, q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        h = self.attn_norm(x)
        # Without a cache the attention gets one input, as tensor parallelism's input hooks
        # (`PrepareModuleInput` in `parallelize_gpt`) expect.
        x = x + self.drop(self.attn(h) if cache is None else self.attn(h, cache, layer))
        return x + self.drop(self.mlp(self.mlp_norm(x)))  # type: ignore[no-any-return]


class Embeddings(nn.Module):
    """Token + learned position embeddings, one module so sequence parallelism can split its
    output along the sequence in one place."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))  # type: ignore[no-any-return]


class GPT(nn.Module):
    family = "gpt"
    """Read by `hpcml.distributed.parallelize` to pick this family's tensor-parallel plan."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.vocab_multiple < 1:
            from hpcml.errors import ModelError

            raise ModelError(
                f"gpt vocab_multiple {cfg.vocab_multiple} must be at least 1 (1: no padding)."
            )
        if cfg.d_model % cfg.n_head:
            from hpcml.errors import ModelError

            raise ModelError(
                f"gpt d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}; "
                "choose sizes where d_model / n_head is a whole head dimension."
            )
        self.cfg = cfg
        self.emb = Embeddings(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.emb.tok.weight
        self.vocab_mask: torch.Tensor | None = None
        """0 on the vocabulary's columns, -inf on the padding's: set (vocabulary-sharded) by
        loss-parallel tensor parallelism, whose logits keep every padded column; else None
        and the padded columns are cut off."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p.data)

    def init_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        """Fill the parameter called `name` (as `named_parameters` spells it) by GPT-2's rules:
        norms 1 / 0, biases 0, weights and embeddings N(0, 0.02), and the projections that write
        into the residual stream N(0, 0.02 / sqrt(2 n_layer)). Meta-device initialisation
        (`hpcml.distributed.meta_init`) calls it per parameter with a generator of its own."""
        with torch.no_grad():
            if "norm." in name and name.endswith("weight"):
                nn.init.ones_(tensor)
            elif name.endswith("bias"):
                nn.init.zeros_(tensor)
            elif name.endswith(("attn.wo.weight", "mlp.w2.weight")):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
                nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)
            else:
                nn.init.normal_(tensor, mean=0.0, std=0.02, generator=generator)

    def forward(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for `idx`; with `cache`, `positions` (same shape) place the tokens after the
        ones already cached (see the module docstring). `rows` (indices along the sequence):
        logits of those positions only, (batch, len(rows), vocab); the final norm and the LM
        head, per position, then skip the others (a prefill needs only its last position's)."""
        x = self.emb(idx) if positions is None else self.emb(idx, positions)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache, i)
        if rows is not None:
            x = x[:, rows]
        logits: torch.Tensor = self.lm_head(self.norm(x))
        if self.vocab_mask is not None:  # padded columns kept, with no probability
            logits = logits + self.vocab_mask
        elif self.cfg.padded_vocab != self.cfg.vocab_size:
            # Padding ids are never a target nor a prediction: drop their columns.
            logits = logits[..., : self.cfg.vocab_size]
        return logits


def build_gpt(**kwargs: Any) -> GPT:
    known = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        from hpcml.errors import ModelError

        raise ModelError(
            f"gpt does not take argument(s) {', '.join(unknown)}; known arguments are: "
            f"{', '.join(sorted(known))}."
        )
    return GPT(GPTConfig(**kwargs))


def matmul_parameters(cfg: GPTConfig) -> int:
    """Parameters that take part in a matrix multiply per token: every weight except the
    position table, and except the token table when it is not also the output projection
    (an embedding lookup is not a matmul). Norm and bias parameters are included; they are
    well under 1% of the total."""
    model_params = parameters(cfg)
    excluded = cfg.max_seq_len * cfg.d_model
    if not cfg.tie_embeddings:
        excluded += cfg.padded_vocab * cfg.d_model
    return model_params - excluded


def parameters(cfg: GPTConfig) -> int:
    d, v, h, n = cfg.d_model, cfg.padded_vocab, cfg.mlp_hidden, cfg.n_layer
    b = 1 if cfg.bias else 0
    attn = 4 * (d * d + b * d)
    mlp_in = (2 if cfg.mlp == "swiglu" else 1) * (d * h + b * h)
    mlp = mlp_in + h * d + b * d
    norms = 2 * (d + b * d)
    block = attn + mlp + norms
    emb = v * d + cfg.max_seq_len * d
    head = 0 if cfg.tie_embeddings else v * d
    return n * block + emb + (d + b * d) + head


def train_flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """6N + 12 L H Q T (PaLM, Chowdhery et al. 2022, appendix B): 6 FLOPs per matmul parameter
    (forward 2, backward 4) plus the attention scores and their weighted sum, counted for the
    full T x T matrix as the kernels compute it."""
    t = seq_len or cfg.max_seq_len
    return 6 * matmul_parameters(cfg) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * t


def config_of(args: dict[str, Any]) -> GPTConfig:
    return GPTConfig(**args)


def describe(cfg: GPTConfig) -> dict[str, Any]:
    return asdict(cfg)
