"""Per-device training memory: parameters, gradients, optimizer states, activations, buffers.

Model states follow the ZeRO paper (Rajbhandari et al. 2019, Sec. 3.1 and 5); activations of
transformer blocks follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Sec. 4 and Table 2). `per_device_bytes` is the entry point.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcml.plan import recompute as recompute_policy
from hpcml.plan.activations import (
    activation_bytes_per_layer,
    inflight_microbatches,
    output_grad_bytes,
)
from hpcml.plan.common import DTYPE_BYTES, PlanError, normalize_precision
from hpcml.plan.shapes import ModelShape
from hpcml.plan.zero1 import busiest_rank_optimizer_bytes

# Optimizer state bytes per parameter, without an fp32 master copy.
#   adam/adamw: first and second moments in fp32 (Kingma & Ba 2015); ZeRO's K = 12 is these
#   8 bytes plus the 4-byte master weights of mixed precision (ZeRO paper, Sec. 3.1).
#   sgd: one fp32 momentum buffer. adam8bit: two 8-bit moments (Dettmers et al. 2022,
#   "8-bit Optimizers via Block-wise Quantization"; the per-block fp32 scale is 4 bytes per
#   2048 values and ignored).
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adamw": 8.0,
    "adam": 8.0,
    "sgd": 4.0,
    "sgd-nomomentum": 0.0,
    "adam8bit": 2.0,
}
# Bytes read + written per parameter by one optimizer step (fp32 states), for its roofline time.
OPTIMIZER_TRAFFIC_BYTES: dict[str, float] = {
    "adamw": 28.0,  # read p, g, m, v; write p, m, v
    "adam": 28.0,
    "sgd": 20.0,  # read p, g, buf; write p, buf
    "sgd-nomomentum": 12.0,
    "adam8bit": 16.0,
}
WEIGHT_MODES = ("pure", "amp", "mixed")
# What a device loses before the first tensor: the CUDA context with cuBLAS/cuDNN/NCCL
# workspaces (about 0.5-1 GB on Hopper with torch 2.x; `plan memory --reserve-gb` changes
# it), and the share the caching allocator loses to fragmentation (`--usable`).
CUDA_RESERVE_BYTES = 1.0e9
USABLE_FRACTION = 0.9
RECOMPUTE = recompute_policy.NAMES
OFFLOAD = ("none", "optimizer", "params")
ATTENTION = ("eager", "sdpa", "flash")
"""eager materialises the s x s softmax (and dropout) per head and keeps it for backward;
sdpa and flash (PyTorch's scaled_dot_product_attention with a fused kernel, FlashAttention,
Dao et al. 2022) keep only Q, K, V, the output and a per-row log-sum-exp."""
GRAD_DTYPES = ("bf16", "fp16", "fp32")
SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class Training:
    """How the model trains: precision, weight storage and optimizer."""

    precision: str = "bf16"
    optimizer: str = "adamw"
    weights: str | None = None
    """pure: everything in `precision`; amp: fp32 weights and gradients, activations in
    `precision` (torch autocast); mixed: half-precision weights and gradients with an fp32
    master copy in the optimizer (Micikevicius et al. 2018; the ZeRO paper's 16 bytes/param).
    Default: mixed for 16-bit precisions, pure otherwise."""
    grad_dtype: str | None = None
    """Gradient (and reduce) element type: fp32 as FSDP2's MixedPrecisionPolicy with
    reduce_dtype=float32 and Megatron-LM's main_grads keep them; default: the weights' type."""
    fused: bool = False
    """The optimizer's fused kernel (hpcml train's, where torch has one): one kernel per step
    and no temporaries; False: torch's foreach implementation (its default on CUDA)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        opt = self.optimizer.lower()
        if opt not in OPTIMIZER_STATE_BYTES:
            raise PlanError(
                f"optimizer '{self.optimizer}' is not known; use one of "
                f"{', '.join(OPTIMIZER_STATE_BYTES)}."
            )
        object.__setattr__(self, "optimizer", opt)
        if self.weights is not None and self.weights not in WEIGHT_MODES:
            raise PlanError(
                f"weights mode '{self.weights}' is not known; use one of {', '.join(WEIGHT_MODES)}."
            )
        if self.grad_dtype is not None:
            g = normalize_precision(self.grad_dtype)
            if g not in GRAD_DTYPES:
                raise PlanError(
                    f"--grad-dtype '{self.grad_dtype}' is not a gradient type; use one of "
                    f"{', '.join(GRAD_DTYPES)}."
                )
            object.__setattr__(self, "grad_dtype", g)

    @property
    def weight_mode(self) -> str:
        if self.weights:
            return self.weights
        return "mixed" if DTYPE_BYTES[self.precision] < 4 else "pure"

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def param_bytes(self) -> int:
        return 4 if self.weight_mode == "amp" else self.compute_bytes

    @property
    def grad_bytes(self) -> int:
        if self.grad_dtype is not None:
            return DTYPE_BYTES[self.grad_dtype]
        return self.param_bytes

    @property
    def activation_bytes(self) -> int:
        return self.compute_bytes

    @property
    def optimizer_bytes_per_param(self) -> float:
        base = OPTIMIZER_STATE_BYTES[self.optimizer]
        return base + (4.0 if self.weight_mode == "mixed" else 0.0)


@dataclass(frozen=True)
class Layout:
    """How the work is split: tensor, pipeline and data parallel degrees, ZeRO, batches."""

    tp: int = 1
    pp: int = 1
    zero: int = 0
    """0 plain data parallel (DDP); 1 optimizer states, 2 + gradients, 3 + parameters sharded
    over the data-parallel group (ZeRO-3 = FSDP full sharding)."""
    sp: bool = False
    """Megatron sequence parallelism along with tensor parallelism."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """Model chunks per pipeline stage for the interleaved schedule."""
    micro_batch: int = 1
    grad_accum: int = 1
    """Micro-batches per optimizer step on each data-parallel replica (the pipeline's m)."""
    recompute: str = "none"
    offload: str = "none"
    """optimizer: optimizer states and this device's gradient shard live on the host and the
    step runs there (ZeRO-Offload, Ren et al. 2021); params: parameter shards too (ZeRO-3)."""
    sp_saves_gathered: bool = False
    """Under sequence parallelism, torch's DTensor plan keeps the all-gathered inputs of the
    attention, MLP and output matmuls for backward; Megatron-LM keeps its shard and gathers
    again in backward (Korthikanti et al. 2022, Sec. 4.2.2), the default here."""
    vocab_parallel_loss: bool = True
    """Megatron computes the cross-entropy on vocabulary shards; hpcml's gpt TP plan gathers
    whole logits on every rank (False)."""
    attention: str | None = None
    """eager, sdpa or flash; None takes the model's own (sdpa for the zoo's gpt, flash for
    other transformers)."""
    accum_reduce: str = "step"
    """ZeRO-2/3 (FSDP2) with grad_accum > 1: `step` keeps unsharded gradients through the
    accumulation (reduced once per step); `micro_batch` reduce-scatters every micro-batch and
    keeps only the shard (hpcml's parallel.accum_reduce)."""
    keep_gathered: bool = False
    """ZeRO-3 as FSDP2 with reshard_after_forward=False (hpcml's zero2): every unit stays
    gathered from its forward to its backward, the whole model at backward's start."""
    zero1_whole_tensors: bool = False
    """ZeRO-1 as torch's ZeroRedundancyOptimizer (hpcml's zero1) shards the optimizer state:
    whole parameter tensors per rank (hpcml.plan.zero1). False: by elements, 1/dp each
    (ZeRO paper, DeepSpeed, Megatron-LM's distributed optimizer)."""

    def dp(self, devices: int) -> int:
        mp = self.tp * self.pp
        if self.tp < 1 or self.pp < 1:
            raise PlanError(f"tp={self.tp} and pp={self.pp} must both be at least 1.")
        if devices % mp:
            raise PlanError(
                f"tp={self.tp} x pp={self.pp} = {mp} does not divide {devices} devices; choose "
                "degrees whose product divides --devices."
            )
        return devices // mp

    def validate(self, model: ModelShape, devices: int) -> int:
        """Check the layout against the model and device count; return the data-parallel degree."""
        dp = self.dp(devices)
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"--zero {self.zero} is not a ZeRO stage; use 0, 1, 2 or 3.")
        policy = recompute_policy.parse(self.recompute)
        if model.is_transformer:
            recompute_policy.check_attention(policy, self.attention or model.attention)
        if self.attention is not None and self.attention not in ATTENTION:
            raise PlanError(
                f"attention '{self.attention}' is not known; use {', '.join(ATTENTION)}."
            )
        if self.accum_reduce not in ("step", "micro_batch"):
            raise PlanError(
                f"accum_reduce '{self.accum_reduce}' is not known; use step or micro_batch."
            )
        if self.offload not in OFFLOAD:
            raise PlanError(f"offload '{self.offload}' is not known; use {', '.join(OFFLOAD)}.")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule '{self.schedule}' is not known; use {', '.join(SCHEDULES)}.")
        if self.micro_batch < 1 or self.grad_accum < 1:
            raise PlanError("--micro-batch and --grad-accum must be at least 1.")
        if self.offload == "params" and self.zero != 3:
            raise PlanError(
                "offloading parameters needs ZeRO-3 (ZeRO-Infinity); pass --zero 3 or "
                "--offload optimizer."
            )
        if self.zero >= 2 and self.pp > 1:
            # DeepSpeed refuses ZeRO-2/3 with pipeline parallelism, and Megatron's distributed
            # optimizer is ZeRO-1: gradients must persist across the pipeline's micro-batches.
            raise PlanError(
                f"ZeRO-{self.zero} does not combine with pipeline parallelism (pp={self.pp}); "
                "use --zero 0 or 1 with --pp."
            )
        if (self.tp > 1 or self.pp > 1) and not model.is_transformer:
            raise PlanError(
                f"tensor and pipeline parallelism need a transformer shape; '{model.name}' has "
                "none, so use --tp 1 --pp 1 or describe it with --layers/--hidden/--heads."
            )
        if model.is_transformer:
            if model.heads % self.tp or (model.kv_heads or model.heads) % self.tp:
                raise PlanError(
                    f"tp={self.tp} does not divide the {model.heads} attention heads "
                    f"({model.kv_heads or model.heads} key/value heads) of {model.name}; choose "
                    "a tensor-parallel degree that divides both."
                )
            chunks = self.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)
            if chunks > model.layers:
                raise PlanError(
                    f"pp={self.pp} (x{self.virtual_stages} virtual) splits {model.layers} layers "
                    "into more stages than layers; lower --pp."
                )
            if self.schedule == "interleaved" and self.grad_accum % self.pp:
                raise PlanError(
                    f"the interleaved schedule needs micro-batches ({self.grad_accum}) to be a "
                    f"multiple of pp={self.pp} (Narayanan et al. 2021); adjust --grad-accum."
                )
        return dp


@dataclass(frozen=True)
class MemoryBreakdown:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    """Communication buffers: DDP's gradient buckets, ZeRO-3's gathered layers."""
    optimizer_temp_bytes: float
    """Temporaries of the optimizer step, alive after the activations are freed."""
    host_bytes: float
    """Bytes offloaded to host memory per device."""
    device_memory_bytes: int | None
    notes: tuple[str, ...] = field(default=())
    grads_held_bytes: float = 0.0
    """Gradients alive while the last micro-batch runs forward: DDP's buckets (they outlive
    zero_grad), the earlier micro-batches' under accumulation; 0 when zero_grad frees them."""
    backward_start_bytes: float = 0.0
    """What backward adds before it frees an activation: the gradient of the output (fp32
    logits' for a transformer) and the first layer's gradients (the output layer's)."""

    @property
    def step_peak_bytes(self) -> float:
        """The most bytes alive at once in a steady step, phase by phase: backward's start
        (activations, the gradients held, the output's gradient and the first layer's
        gradients) or backward's end and the optimizer step (all gradients and the
        optimizer's temporaries), over parameters, optimizer states and buffers."""
        start = self.grads_held_bytes + self.activations_bytes + self.backward_start_bytes
        end = self.grads_bytes + self.optimizer_temp_bytes
        return self.params_bytes + self.optimizer_bytes + self.buffers_bytes + max(start, end)

    @property
    def model_states_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        """Peak: model states and buffers, plus the larger of activations and optimizer temps."""
        return (
            self.model_states_bytes
            + self.buffers_bytes
            + max(self.activations_bytes, self.optimizer_temp_bytes)
        )

    def fits(
        self, usable_fraction: float = USABLE_FRACTION, reserve_bytes: float = CUDA_RESERVE_BYTES
    ) -> bool:
        """Peak plus the CUDA context and allocator reserve within a share of device memory."""
        room = self.headroom_bytes(usable_fraction, reserve_bytes)
        return room is None or room >= 0

    def budget_bytes(
        self, usable_fraction: float = USABLE_FRACTION, reserve_bytes: float = CUDA_RESERVE_BYTES
    ) -> float | None:
        """What the plan may use: the usable share of device memory less the reserve."""
        if self.device_memory_bytes is None:
            return None
        return usable_fraction * self.device_memory_bytes - reserve_bytes

    def headroom_bytes(
        self, usable_fraction: float = USABLE_FRACTION, reserve_bytes: float = CUDA_RESERVE_BYTES
    ) -> float | None:
        """Budget left after the peak (negative: over by that much); None off a device."""
        budget = self.budget_bytes(usable_fraction, reserve_bytes)
        return None if budget is None else budget - self.total_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["model_states_bytes"] = self.model_states_bytes
        d["total_bytes"] = self.total_bytes
        d["step_peak_bytes"] = self.step_peak_bytes
        return d


# --- model states ----------------------------------------------------------------------------


def zero_model_state_bytes(
    params: float,
    dp: int,
    stage: int,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> tuple[float, float, float]:
    """Per-device (params, grads, optimizer) bytes under ZeRO stage 0-3.

    ZeRO paper, Sec. 5.1 and Figure 1: baseline (2 + 2 + K)Psi; P_os 2Psi + 2Psi + K Psi/Nd;
    P_os+g 2Psi + (2 + K)Psi/Nd; P_os+g+p (2 + 2 + K)Psi/Nd, with K = 12 for mixed-precision
    Adam.
    """
    p = params * param_bytes
    g = params * grad_bytes
    o = params * optimizer_bytes
    if stage >= 1:
        o /= dp
    if stage >= 2:
        g /= dp
    if stage >= 3:
        p /= dp
    return p, g, o


def params_per_device(model: ModelShape, layout: Layout) -> float:
    """Parameters held by the busiest device before ZeRO sharding: one pipeline stage / tp."""
    if not model.is_transformer or layout.pp == 1:
        return model.params / layout.tp
    layers_per_stage = math.ceil(model.layers / layout.pp)
    # With pp > 1 the first stage holds the input embedding and the last one the output layer
    # (a second copy when tied, as Megatron-LM does); both are about V*h.
    edge = model.vocab * model.hidden + (
        model.non_layer_params - model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
    )
    return (layers_per_stage * model.layer_params + edge) / layout.tp


def largest_layer_params(model: ModelShape, layout: Layout) -> float:
    """Parameters of the biggest unit ZeRO-3 gathers at once (a block or the embedding)."""
    if model.largest_layer_params:
        return model.largest_layer_params / layout.tp
    if model.is_transformer:
        return max(model.layer_params, model.vocab * model.hidden) / layout.tp
    raise PlanError(
        f"ZeRO-3 gathers one layer at a time, and '{model.name}' is given by its parameter "
        "count alone; pass --largest-layer N (parameters of its biggest layer) or describe it "
        "with --layers/--hidden/--heads."
    )


# --- activations -----------------------------------------------------------------------------


def stage_activation_terms(
    model: ModelShape, layout: Layout, act_bytes: int
) -> tuple[float, float, float, float]:
    """What one micro-batch keeps for backward on a pipeline stage of a transformer: (its
    blocks, the output layer on the last stage, the input embedding's dropout mask on the
    first, one block without recomputation)."""
    attention = layout.attention or model.attention
    policy = recompute_policy.parse(layout.recompute)

    def per_layer(recompute: str) -> float:
        return activation_bytes_per_layer(
            model.seq,
            layout.micro_batch,
            model.hidden,
            model.heads,
            layout.tp,
            layout.sp,
            recompute,
            act_bytes,
            model.dropout,
            model.ffn_hidden,
            model.gated_mlp,
            model.kv_heads,
            attention,
            layout.sp_saves_gathered,
        )

    layers_per_stage = math.ceil(model.layers / layout.pp)
    kept = per_layer("none")
    if policy.kind == "layer":
        n = policy.recomputed_blocks(layers_per_stage)
        stage = n * per_layer("full") + (layers_per_stage - n) * kept
    else:
        stage = layers_per_stage * per_layer(policy.kind)
    t = layout.tp
    sbh = float(model.seq) * layout.micro_batch * model.hidden
    sbv = float(model.seq) * layout.micro_batch * model.vocab
    # Korthikanti et al. 2022, Sec. 4.3: the output layer keeps the final LayerNorm and
    # projection inputs and fp32 logits for the cross-entropy, 4sbh/t (1 + v/h) for 16-bit
    # activations; the input embedding keeps a dropout mask of sbh.
    # Without sequence parallelism the final norm and head inputs are whole on every rank;
    # without a vocabulary-parallel loss (Megatron's) the fp32 log-probabilities are too.
    head_input = act_bytes * sbh / (t if layout.sp and not layout.sp_saves_gathered else 1)
    output = (
        act_bytes * sbh / (t if layout.sp else 1)
        + head_input
        + 4.0 * sbv / (t if layout.vocab_parallel_loss else 1)
    )
    embed_mask = (sbh if model.dropout else 0.0) / (t if layout.sp else 1)
    return stage, output, embed_mask, kept


def transformer_activation_bytes(model: ModelShape, layout: Layout, act_bytes: int) -> float:
    """Activation bytes of the busiest pipeline stage of a transformer."""
    stage, output, embed_mask, kept = stage_activation_terms(model, layout, act_bytes)
    inflight = inflight_microbatches(
        layout.pp, layout.grad_accum, layout.schedule, layout.virtual_stages
    )
    first = inflight * (stage + embed_mask)
    last = stage + output
    acts = first + output if layout.pp == 1 else max(first, last)
    if recompute_policy.parse(layout.recompute).recomputes_blocks:
        # The block being recomputed during backward holds its full activations meanwhile.
        acts += kept
    return acts


# --- the whole picture -----------------------------------------------------------------------


def per_device_bytes(
    model: ModelShape,
    layout: Layout,
    training: Training,
    devices: int,
    device_memory_bytes: int | None = None,
    ddp_bucket_copy: bool = False,
) -> MemoryBreakdown:
    """Bytes on the busiest device of a training job.

    `ddp_bucket_copy`: torch DDP's default (gradient_as_bucket_view=False) keeps a second copy
    of the gradients in its all-reduce buckets; hpcml train, Megatron-LM and DeepSpeed reduce
    in place, which is the default here.
    """
    dp = layout.validate(model, devices)
    notes: list[str] = []
    n_params = params_per_device(model, layout)
    p_bytes, g_bytes, o_bytes = zero_model_state_bytes(
        n_params,
        dp,
        layout.zero,
        training.param_bytes,
        training.grad_bytes,
        training.optimizer_bytes_per_param,
    )
    # torch's Adam/AdamW keep a float32 `step` tensor per parameter tensor.
    step_bytes = 4.0 if training.optimizer in ("adamw", "adam") else 0.0
    o_bytes += step_bytes * model.param_tensors / (dp if layout.zero >= 1 else 1)
    opt_elements = n_params / (dp if layout.zero >= 1 else 1)
    if layout.zero == 1 and dp > 1 and layout.zero1_whole_tensors:
        if model.param_tensor_sizes and layout.tp == 1 and layout.pp == 1:
            # Whole tensors per rank: the busiest rank holds more than 1/dp of the state, as
            # measured on hpcml's zero1 runs (benchmarks/results/plan_check.md).
            o_bytes, opt_elements = busiest_rank_optimizer_bytes(
                model.param_tensor_sizes, dp, training.optimizer_bytes_per_param, step_bytes
            )
        else:
            notes.append(
                "ZeRO-1 with whole tensors per rank (torch's ZeroRedundancyOptimizer) needs the "
                "model's tensor sizes; predicted as an even split, which the busiest rank exceeds"
            )

    host = 0.0
    if layout.offload in ("optimizer", "params"):
        # ZeRO-Offload (Ren et al. 2021): optimizer states (and the step) live on the host,
        # and so does the gradient shard they update once it has been reduced (ZeRO-2/3);
        # without gradient sharding the full gradients are all-reduced on the device first.
        host += o_bytes
        o_bytes = 0.0
        if layout.zero >= 2:
            host += g_bytes
            g_bytes = 0.0
    if layout.offload == "params":
        # ZeRO-Infinity (Rajbhandari et al. 2021): sharded parameters wait on the host too.
        host += p_bytes
        p_bytes = 0.0

    if layout.zero >= 2 and dp > 1 and layout.grad_accum > 1 and layout.accum_reduce == "step":
        # FSDP2 without gradient sync on the earlier micro-batches (set_requires_gradient_sync)
        # keeps each unit's unsharded gradient on the device until the last one reduce-scatters it.
        g_bytes += n_params * training.grad_bytes
        notes.append(
            "gradients held unsharded through the accumulation (parallel.accum_reduce: step); "
            "micro_batch keeps only the shard"
        )

    if model.activations_traced and model.activation_bytes_per_sample is not None:
        # Traced at the run's own precision, input shape and recomputation (plan memory --trace).
        acts = model.activation_bytes_per_sample * layout.micro_batch
    elif model.is_transformer:
        acts = transformer_activation_bytes(model, layout, training.activation_bytes)
    elif model.activation_bytes_per_sample is not None:
        acts = (
            model.activation_bytes_per_sample * layout.micro_batch * training.activation_bytes / 4
        )
        if layout.recompute != "none":
            notes.append("recomputation is modelled for transformers only; ignored here")
    else:
        acts = 0.0
        notes.append("activations unknown: give --layers/--hidden/--heads/--seq to count them")

    buffers = 0.0
    if layout.zero == 0 and dp > 1 and ddp_bucket_copy:
        # torch DDP copies gradients into flat all-reduce buckets unless
        # gradient_as_bucket_view=True ("the saved memory size will be equal to the total
        # gradients size", torch/nn/parallel/distributed.py).
        buffers += g_bytes
    if layout.zero == 3 and dp > 1:
        # The gathered current layer and the prefetched next one (DeepSpeed's ZeRO-3
        # estimator counts the largest layer, deepspeed/runtime/zero/stage3.py), gathered in
        # the compute type: FSDP2's MixedPrecisionPolicy casts fp32 shards to bf16 before the
        # all-gather (hpcml's bf16), and DeepSpeed's bf16 weights are bf16 already.
        gathered = n_params if layout.keep_gathered else 2.0 * largest_layer_params(model, layout)
        buffers += gathered * training.compute_bytes

    # torch's foreach Adam builds one state-sized temporary (the sqrt of the second moment).
    opt_temp = 0.0
    if training.optimizer in ("adamw", "adam") and layout.offload == "none" and not training.fused:
        opt_temp = opt_elements * 4.0

    # DDP (ZeRO-1 under it) reduces in buckets that hold every gradient from the first
    # backward on; accumulation keeps the earlier micro-batches' gradients.
    held = g_bytes if (layout.zero <= 1 and dp > 1) or layout.grad_accum > 1 else 0.0
    first = output_grad_bytes(model, layout.micro_batch, layout.tp, layout.vocab_parallel_loss)
    if not held and model.is_transformer:  # the output layer's weight gradient
        first += model.vocab * model.hidden / layout.tp * training.grad_bytes
    return MemoryBreakdown(
        grads_held_bytes=held,
        backward_start_bytes=first,
        params_bytes=p_bytes,
        grads_bytes=g_bytes,
        optimizer_bytes=o_bytes,
        activations_bytes=acts,
        buffers_bytes=buffers,
        optimizer_temp_bytes=opt_temp,
        host_bytes=host,
        device_memory_bytes=device_memory_bytes,
        notes=tuple(notes),
    )
