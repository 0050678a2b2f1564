"""Model shapes the planner reasons about: parameter counts, FLOPs per sample and the dimensions
the activation formulas need. Plain numbers, no torch: zoo CNNs are a small table (checked
against the zoo by a test), transformers are computed from their dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hpcml.plan.common import PlanError
from hpcml.plan.flops import (  # noqa: F401  (re-exported)
    megatron_flops_per_iteration,
    megatron_params,
    palm_flops_per_token,
)
from hpcml.plan.model_specs import (  # noqa: F401  (ZOO_GPT_* re-exported)
    TRANSFORMER_SPECS,
    ZOO_GPT_DEFAULTS,
    ZOO_GPT_SIZES,
)


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: int
    kind: str = "generic"
    """"transformer" (decoder blocks with the dimensions below) or "generic" (numbers only)."""
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    seq: int = 1
    """Tokens per sample; 1 for images."""
    vocab: int = 0
    ffn_hidden: int = 0
    gated_mlp: bool = False
    non_layer_params: int = 0
    """Parameters outside the repeated blocks: embeddings, output head, final norm."""
    lookup_only_params: int = 0
    """Parameters used as a table lookup, not a matmul (untied input embedding, positions)."""
    forward_flops_per_sample: float = 0.0
    """Generic models: forward FLOPs of one sample (multiply-add = 2)."""
    activation_bytes_per_sample: float | None = None
    """Generic models: bytes autograd saves per sample in fp32, excluding the parameters."""
    activations_traced: bool = False
    """activation_bytes_per_sample was traced at the run's own precision (plan memory
    --trace), not counted in fp32: it is not rescaled to the activation type."""
    dropout: bool = True
    tied_embeddings: bool = True
    param_tensors: int = 0
    """Number of parameter tensors (torch's AdamW keeps a 4-byte step per tensor); 0 unknown."""
    param_tensor_sizes: tuple[tuple[int, ...], ...] = ()
    """Elements of each parameter tensor in hpcml's two optimizer groups with weight decay on
    (decayed, then exempt: norms, biases, embeddings; hpcml.train.schedule.param_groups); ()
    unknown. torch's ZeRO-1 partitions whole tensors (hpcml.plan.zero1)."""
    source: str = ""
    attention: str = "flash"
    """Transformers: the attention kernel it trains with (eager, sdpa, flash)."""
    largest_layer_params: float = 0.0
    """Parameters of the biggest unit ZeRO-3 gathers at once; 0: derived or unknown."""
    units: int = 0
    """Units ZeRO-3 gathers one at a time (hpcml.distributed.wrapping.units); 0: a
    transformer's layers, else 1."""
    buffer_groups: int = 0
    """Dtypes among the model's buffers (BatchNorm: float statistics and an int64 counter): DDP
    broadcasts buffers once per step, one call per dtype; 0 without buffers."""
    buffer_bytes: int = 0
    """Bytes of those buffers."""

    @property
    def gather_units(self) -> int:
        """Collectives per ZeRO-3 pass: one per unit, and one for the root's parameters
        (embeddings, head) when the model has them."""
        n = self.units or self.layers or 1
        return n + (1 if self.non_layer_params else 0)

    @property
    def is_transformer(self) -> bool:
        return self.kind == "transformer"

    @property
    def layer_params(self) -> float:
        if not self.layers:
            return float(self.params)
        return (self.params - self.non_layer_params) / self.layers

    def model_flops_per_sample(self) -> float:
        """Training FLOPs (forward + backward) of one sample, recomputation not counted.

        Transformers: PaLM's 6N + 12*L*H*Q*T per token (Chowdhery et al. 2022, Appendix B),
        with N the parameters that take part in matmuls (an untied input embedding is a
        lookup). Equal to Megatron-LM's 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) per batch
        (Korthikanti et al. 2022, Eq. 7). Other models: backward = 2 x forward, so 3 x forward
        (Kaplan et al. 2020, Sec. 2.1).
        """
        if self.is_transformer:
            per_token = palm_flops_per_token(
                self.params - self.lookup_only_params, self.layers, self.hidden, self.seq
            )
            return per_token * self.seq
        return 3.0 * self.forward_flops_per_sample

    def hardware_flops_per_sample(self, recompute: str = "none") -> float:
        """FLOPs the device executes, recomputation included (hpcml.plan.recompute's policies).

        full: one more forward pass of every block, as in Narayanan et al. 2021 Eq. 3
        (96BLsh^2 instead of 72BLsh^2); layer:K: of every K-th block. attention-scores: one
        more forward of the attention core, QK^T and the weighted sum over V, 4*B*s^2*h per
        layer (a third of the attention term; Korthikanti et al. 2022 Eq. 8 counts the whole
        term again instead, `megatron_flops_per_iteration`; the forward-only count is what the
        device runs). op: the matmuls the policy does not save, once more.
        """
        from hpcml.plan.recompute import op_recomputed_flops_per_token, parse

        policy = parse(recompute)
        model = self.model_flops_per_sample()
        if policy.kind == "none":
            return model
        if not self.is_transformer:
            # Generic models have no blocks or attention core; full recomputation adds a forward.
            return model * 4.0 / 3.0 if policy.kind == "full" else model
        attn = 12.0 * self.layers * self.hidden * self.seq * self.seq
        if policy.kind == "attention-scores":
            return model + attn / 3.0
        if policy.kind == "op":
            kv_width = self.hidden // self.heads * (self.kv_heads or self.heads)
            per_token = op_recomputed_flops_per_token(
                self.hidden, kv_width, self.ffn_hidden or 4 * self.hidden, self.gated_mlp
            )
            return model + self.layers * self.seq * per_token
        matmul_n = self.params - self.lookup_only_params
        head = self.vocab * self.hidden  # the output layer is not recomputed
        layers_forward = 2.0 * (matmul_n - head) * self.seq + attn / 3.0
        return model + layers_forward * policy.recomputed_blocks(self.layers) / self.layers

    @property
    def tokens_per_sample(self) -> int:
        return self.seq if self.is_transformer else 1


def transformer(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    ffn_hidden: int | None = None,
    kv_heads: int | None = None,
    gated_mlp: bool = False,
    tied_embeddings: bool = True,
    learned_positions: bool = True,
    biases: bool = True,
    dropout: bool = True,
    params: int | None = None,
    source: str = "",
) -> ModelShape:
    """A decoder-only transformer; parameters counted from its dimensions unless given.

    GPT blocks (biases, LayerNorm with weight and bias, 4h MLP) have 12h^2 + 13h parameters
    (Narayanan et al. 2021, Eq. 2); Llama blocks (no biases, RMSNorm, SwiGLU with 3 matrices)
    have 2h^2 + 2h*kv_width + 3*h*ffn + 2h (Touvron et al. 2023, Table 2 sizes check out).
    """
    for label, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq)):
        if value < 1:
            raise PlanError(f"transformer '{name}': {label} is {value}; it must be at least 1.")
    if hidden % heads:
        raise PlanError(
            f"transformer '{name}': hidden {hidden} is not divisible by heads {heads}; "
            "pick a head count that divides the hidden size."
        )
    ffn = ffn_hidden or 4 * hidden
    kvh = kv_heads or heads
    if kvh < 1 or heads % kvh:
        raise PlanError(
            f"transformer '{name}': {kvh} key/value heads do not divide {heads} attention heads; "
            "grouped-query attention shares each key/value head among heads/kv_heads query "
            "heads, so pick a --kv-heads that divides --heads."
        )
    kv_width = hidden // heads * kvh
    attn = hidden * (hidden + 2 * kv_width) + hidden * hidden
    mlp = (3 if gated_mlp else 2) * hidden * ffn
    norms = (4 if biases else 2) * hidden
    bias = (
        (hidden + 2 * kv_width + hidden + ffn * (2 if gated_mlp else 1) + hidden) if biases else 0
    )
    per_layer = attn + mlp + norms + bias
    embed = vocab * hidden
    positions = seq * hidden if learned_positions else 0
    head = 0 if tied_embeddings else vocab * hidden
    final_norm = (2 if biases else 1) * hidden
    non_layer = embed + positions + head + final_norm
    counted = layers * per_layer + non_layer
    lookup = positions + (0 if tied_embeddings else embed)
    return ModelShape(
        name=name,
        params=int(params if params is not None else counted),
        kind="transformer",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kvh,
        seq=seq,
        vocab=vocab,
        ffn_hidden=ffn,
        gated_mlp=gated_mlp,
        non_layer_params=non_layer,
        lookup_only_params=lookup,
        dropout=dropout,
        tied_embeddings=tied_embeddings,
        source=source,
    )


def zoo_gpt_shape(
    name: str, args: Mapping[str, Any] | None = None, seq: int | None = None
) -> ModelShape:
    """A zoo gpt size with its builder arguments, counted as hpcml.models.gpt builds it."""
    unknown = sorted(set(args or {}) - set(ZOO_GPT_DEFAULTS))
    if unknown:
        raise PlanError(
            f"gpt does not take argument(s) {', '.join(unknown)}; known arguments are: "
            f"{', '.join(sorted(ZOO_GPT_DEFAULTS))}."
        )
    c = {**ZOO_GPT_DEFAULTS, **ZOO_GPT_SIZES[name], **(args or {})}
    d = int(c["d_model"])
    ffn = int(float(c["mlp_ratio"]) * d)
    swiglu = c["mlp"] == "swiglu"
    if swiglu:
        ffn = 64 * math.ceil(2 * ffn / 3 / 64)  # GPTConfig.mlp_hidden's rounding
    bias = bool(c["bias"])
    per_block = (
        (2 if bias else 1) * 2 + 4 * (2 if bias else 1) + (3 if swiglu else 2) * (2 if bias else 1)
    )
    tensors = (
        int(c["n_layer"]) * per_block + 2 + (2 if bias else 1) + (0 if c["tie_embeddings"] else 1)
    )
    shape = transformer(
        name,
        int(c["n_layer"]),
        d,
        int(c["n_head"]),
        int(seq or c["max_seq_len"]),
        # GPTConfig.padded_vocab: the token table and head are padded to a kernel-friendly size.
        int(c["vocab_multiple"]) * math.ceil(int(c["vocab_size"]) / int(c["vocab_multiple"])),
        ffn_hidden=ffn,
        gated_mlp=swiglu,
        tied_embeddings=bool(c["tie_embeddings"]),
        learned_positions=True,
        biases=bias,
        dropout=float(c["dropout"]) > 0,
        source=f"hpcml zoo {name}",
    )
    if seq and seq != int(c["max_seq_len"]):
        # The position table is max_seq_len long whatever length a batch uses.
        extra = (int(c["max_seq_len"]) - seq) * d
        shape = replace(
            shape,
            params=shape.params + extra,
            non_layer_params=shape.non_layer_params + extra,
            lookup_only_params=shape.lookup_only_params + extra,
        )
    vocab = shape.vocab
    mlp_mats = 3 if swiglu else 2
    decayed = [d * d] * 4 + [d * ffn] * mlp_mats
    exempt = [d] * (2 if bias else 1) * 2
    if bias:
        exempt += [d] * 4 + [ffn] * (mlp_mats - 1) + [d]
    sizes = (
        tuple(decayed * int(c["n_layer"])) + (() if c["tie_embeddings"] else (vocab * d,)),
        (vocab * d, int(c["max_seq_len"]) * d, *exempt * int(c["n_layer"]))
        + (d,) * (2 if bias else 1),
    )
    return replace(shape, param_tensors=tensors, attention="sdpa", param_tensor_sizes=sizes)


# Zoo CNNs: parameters and forward FLOPs as `hpcml model info` counts them (torch's
# FlopCounterMode, multiply-add = 2); saved activations counted with
# torch.autograd.graph.saved_tensors_hooks over unique storages, parameters excluded, for
# 3x32x32 inputs in fp32; the largest layer is the largest unit hpcml's FSDP2 wrapping
# gathers (hpcml.distributed.wrapping.units). tests/unit/test_plan_zoo_shapes.py re-counts
# them with torch.
_CNN_TABLE: dict[str, ModelShape] = {
    "simple_cnn": ModelShape(
        "simple_cnn",
        2_474_506,
        forward_flops_per_sample=83_240_960,
        activation_bytes_per_sample=1_275_952,
        param_tensors=16,
        param_tensor_sizes=(
            (1728, 73728, 294912, 2097152, 5120),
            (64, 64, 64, 128, 128, 128, 256, 256, 256, 512, 10),
        ),
        source="hpcml zoo, 3x32x32",
        largest_layer_params=2_102_794,
        units=4,
        buffer_groups=2,  # BatchNorm running statistics (float32) and counters (int64)
        buffer_bytes=3608,
    ),
    "resnet18": ModelShape(
        "resnet18",
        11_173_962,
        forward_flops_per_sample=1_110_845_440,
        activation_bytes_per_sample=4_700_208,
        param_tensors=62,
        param_tensor_sizes=(
            (1728, *[36864] * 4, 73728, 147456, 8192, 147456, 147456, 294912, 589824, 32768)
            + (589824, 589824, 1179648, 2359296, 131072, 2359296, 2359296, 5120),
            (*[64] * 10, *[128] * 10, *[256] * 10, *[512] * 10, 10),
        ),
        source="hpcml zoo, CIFAR stem, 3x32x32",
        largest_layer_params=4_720_640,
        units=10,
        buffer_groups=2,
        buffer_bytes=38560,
    ),
}


# The input the CNN table was counted at (per sample); the zoo's default builder arguments.
CNN_TABLE_INPUT = (3, 32, 32)
CNN_TABLE_ARGS: dict[str, Any] = {"num_classes": 10, "in_channels": 3}


def is_table_cnn(name: str) -> bool:
    return name.lower() in _CNN_TABLE


def cnn_table_covers(name: str, args: Mapping[str, Any], input_shape: Any) -> bool:
    """Whether the CNN table's entry for `name` describes the model built with `args` (as the
    engine completes them) on inputs of `input_shape` (None: not recorded)."""
    if name.lower() not in _CNN_TABLE:
        return False
    if any(CNN_TABLE_ARGS.get(k, object()) != v for k, v in args.items()):
        return False
    return input_shape is None or tuple(int(d) for d in input_shape) == CNN_TABLE_INPUT


def mlp_shape(args: Mapping[str, Any]) -> ModelShape:
    """The zoo MLP: Flatten -> [Linear -> ReLU] * depth -> Linear, counted from its arguments."""
    shape = [int(d) for d in args.get("input_shape", (3, 32, 32))]
    width = 1
    for d in shape:
        width *= d
    hidden = int(args.get("hidden", 256))
    depth = int(args.get("depth", 2))
    classes = int(args.get("num_classes", 10))
    dims = [width] + [hidden] * depth + [classes]
    params = sum(a * b + b for a, b in zip(dims, dims[1:], strict=False))
    macs = sum(a * b for a, b in zip(dims, dims[1:], strict=False))
    # Saved for backward: the flattened input, each ReLU output (in place, shared with the
    # next Linear's input), the log-softmax output, and the int64 target.
    saved = 4 * (width + depth * hidden + classes) + 8
    weights = tuple(a * b for a, b in zip(dims, dims[1:], strict=False))
    return ModelShape(
        "mlp",
        params,
        param_tensor_sizes=(weights, tuple(dims[1:])),
        forward_flops_per_sample=2 * macs,
        activation_bytes_per_sample=saved,
        param_tensors=2 * (depth + 1),
        source="hpcml zoo MLP",
        largest_layer_params=params,  # one Sequential: FSDP2 gathers it whole
        units=1,
    )


def known_models() -> list[str]:
    return sorted([*_CNN_TABLE, "mlp", *ZOO_GPT_SIZES, *TRANSFORMER_SPECS])


def model_shape(
    name: str, args: Mapping[str, Any] | None = None, seq: int | None = None
) -> ModelShape:
    """The shape of a zoo model or a known transformer; `seq` overrides a transformer's length."""
    args = dict(args or {})
    key = name.lower()
    if key == "mlp":
        return mlp_shape(args)
    if key in _CNN_TABLE:
        if args:
            raise PlanError(
                f"plan knows {key} with its default arguments only, not {args}; describe it with "
                "--params and --flops-per-sample instead."
            )
        return _CNN_TABLE[key]
    if key in ZOO_GPT_SIZES:
        return zoo_gpt_shape(key, args, seq)
    if key in TRANSFORMER_SPECS:
        layers, hidden, heads, default_seq, kw = TRANSFORMER_SPECS[key]
        kw = dict(kw)
        vocab = int(kw.pop("vocab"))
        return transformer(key, layers, hidden, heads, seq or default_seq, vocab, **kw)
    raise PlanError(
        f"model '{name}' is not known to the planner; known are {', '.join(known_models())}, "
        "or describe it with --params/--layers/--hidden/--heads/--seq/--vocab."
    )


def shape_from_raw(
    params: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
    ffn_hidden: int | None = None,
    kv_heads: int | None = None,
    flops_per_sample: float | None = None,
    name: str = "custom",
    swiglu: bool = False,
    largest_layer: float | None = None,
) -> ModelShape:
    """A shape from raw numbers: a transformer when layers and hidden are given, else generic.
    `swiglu` describes a Llama-style block (gated MLP, no biases, untied embeddings)."""
    if layers and hidden:
        style: dict[str, Any] = (
            {
                "gated_mlp": True,
                "tied_embeddings": False,
                "learned_positions": False,
                "biases": False,
                "dropout": False,
            }
            if swiglu
            else {}
        )
        shape = transformer(
            name,
            layers,
            hidden,
            heads or max(1, hidden // 128),
            seq or 2048,
            vocab or 50257,
            ffn_hidden=ffn_hidden,
            kv_heads=kv_heads,
            params=params,
            source="raw shape",
            **style,
        )
        return replace(shape, largest_layer_params=float(largest_layer or 0.0))
    if not params:
        raise PlanError(
            "describe the model with --model NAME, or --params N (plus --layers and --hidden "
            "for activation memory)."
        )
    return ModelShape(
        name,
        int(params),
        forward_flops_per_sample=flops_per_sample if flops_per_sample else 2.0 * params,
        activation_bytes_per_sample=None,
        source="raw parameter count",
        largest_layer_params=float(largest_layer or 0.0),
    )


def with_params(shape: ModelShape, params: int) -> ModelShape:
    """The same shape with a measured parameter count (e.g. from a run's summary)."""
    delta = params - shape.params
    return replace(
        shape,
        params=params,
        non_layer_params=max(0, shape.non_layer_params + (delta if not shape.layers else 0)),
    )
