"""Wrapping a model and its optimizer for a parallel strategy, and the helpers that must know
how a model is sharded: full (unsharded) state dicts, checkpoint state dicts, gradient-norm
clipping over DTensors, the gradient scaler, and per-rank model-state bytes.

| strategy | parameters | gradients | optimizer state | how                                   |
|----------|------------|-----------|-----------------|---------------------------------------|
| ddp      | replicated | replicated| replicated      | DistributedDataParallel               |
| zero1    | replicated | replicated| sharded         | DDP + ZeroRedundancyOptimizer         |
| zero2    | sharded*   | sharded   | sharded         | FSDP2, reshard_after_forward=False    |
| zero3    | sharded    | sharded   | sharded         | FSDP2 (= fsdp)                        |
* gathered from forward until backward is done with them.
`parallel.tp` adds tensor parallelism (per model family, see `parallelize_gpt`) on the inner
axis of a (dp, tp) device mesh; FSDP then shards over the dp axis.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from hpcml.config import ParallelConfig, TrainConfig
from hpcml.distributed import parallelize_gpt
from hpcml.distributed.precision import Precision
from hpcml.distributed.runtime import Runtime
from hpcml.distributed.wrapping import apply_ac, apply_compile, apply_fsdp, mixed_precision_policy
from hpcml.errors import ConfigError

SHARDED = ("zero2", "zero3", "fsdp")
TP_PLANS: dict[str, Callable[[nn.Module, DeviceMesh, bool, bool], None]] = {
    "gpt": parallelize_gpt.apply_tp,
}
"""Model family (a model's `family` attribute) -> its tensor-parallel plan."""
TP_CHECKS: dict[str, Callable[[nn.Module, int], None]] = {"gpt": parallelize_gpt.check_tp}
"""Model family -> the check that its shapes divide by the tensor-parallel degree."""


def _is_quantized(t: torch.Tensor) -> bool:
    """A torchao int8 or nf4 tensor (a fine-tuning run's frozen quantized base weight)."""
    return hasattr(t, "qdata") or hasattr(t, "quantized_data")


_NO_FORWARD_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)


def apply_ddp(
    model: nn.Module, rt: Runtime, cfg: ParallelConfig, group: dist.ProcessGroup | None = None
) -> nn.Module:
    if cfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # DDP broadcasts rank 0's parameters at wrap time by copying into flat buffers, which
    # re-quantizes an nf4 weight from its dequantized value (new scales: silently other weights)
    # and fails on int8. Frozen quantized weights get no gradients and are built alike on every
    # rank (the same export, deterministic quantization), so DDP leaves them out.
    frozen_quantized = [n for n, p in model.named_parameters() if _is_quantized(p)]
    if frozen_quantized:
        DDP._set_params_and_buffers_to_ignore_for_model(model, frozen_quantized)
    return DDP(
        model,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=True,
        # Not before every forward: training-mode BatchNorm normalizes with the batch's own
        # statistics, so the running ones are needed only by evaluation and checkpoints,
        # which `sync_buffers` serves (rank 0's, as DDP's broadcast would give them).
        # torch 2.13 names it forward_sync_buffers (broadcast_buffers warns on every rank).
        **_NO_FORWARD_BUFFER_SYNC,
        process_group=group,  # the replicas of one pipeline stage under parallel.pp
    )


@torch.no_grad()
def sync_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) to every rank of a DDP model: one
    broadcast per buffer dtype. Every rank calls it, before evaluating or saving."""
    if not isinstance(model, DDP):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in model.module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for group in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(group)
        dist.broadcast(flat, group=model.process_group, group_src=0)
        for b, synced in zip(
            group, torch._utils._unflatten_dense_tensors(flat, group), strict=True
        ):
            b.copy_(synced)


def build_mesh(rt: Runtime) -> DeviceMesh:
    if rt.tp == 1:
        return init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(rt.device.type, (rt.dp_size, rt.tp), mesh_dim_names=("dp", "tp"))


def check_parallel(
    model: nn.Module, world_size: int, tp: int, cfg: ParallelConfig, precision: str
) -> None:
    """Every reason `parallelize` would refuse this model and layout, checked without a process
    group (the model may live on the meta device), so a launcher can check before workers start."""
    if world_size % tp:
        raise ConfigError(
            f"parallel.tp {tp} does not divide the {world_size} processes; start a multiple of "
            f"{tp} processes (--nproc) or lower parallel.tp."
        )
    if tp == 1:
        if cfg.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1; set one of them.")
        return
    family = str(getattr(model, "family", None))
    if family not in TP_PLANS:
        raise ConfigError(
            f"parallel.tp {tp} needs a model family with a tensor-parallel plan "
            f"({', '.join(TP_PLANS)}); this model has none, so set parallel.tp=1."
        )
    dp_size = world_size // (tp * cfg.pp)  # under parallel.pp: the replicas of one stage
    if dp_size > 1 and cfg.strategy not in SHARDED:
        raise ConfigError(
            f"parallel.strategy {cfg.strategy} with parallel.tp {tp} on {world_size} "
            "processes is not supported; combine tensor parallelism with zero2, zero3 or "
            f"fsdp, or run {tp * cfg.pp} processes."
        )
    if precision == "fp16":
        # Loss scaling would have to check plain and DTensor gradients on two meshes at once.
        raise ConfigError(
            "precision fp16 with parallel.tp > 1 is not supported; use precision=bf16, "
            "which needs no loss scaling."
        )
    TP_CHECKS[family](model, tp)


def parallelize(
    model: nn.Module,
    rt: Runtime,
    cfg: ParallelConfig,
    train: TrainConfig | None = None,
    precision: str = "fp32",
    materialize: Callable[[nn.Module], None] | None = None,
    loss_parallel: bool = False,
    mesh: DeviceMesh | None = None,
    data_parallel: bool = True,
) -> nn.Module:
    """Apply, in torchtitan's order, tensor parallelism, activation checkpointing, compile and
    the data-parallel strategy. A single process gets AC and compile only.

    A model on the meta device is given storage by `materialize` once it is sharded: after
    FSDP (each rank allocates its shards only), before DDP (which broadcasts real tensors).
    `loss_parallel` keeps a TP model's logits vocabulary-sharded; the caller then computes the
    loss and its backward inside `loss_context(model)`. `mesh`: a device mesh with "dp" (and
    "tp") dimensions to use instead of one over every rank: under parallel.pp the pipeline's
    (pp, dp[, tp]) mesh, whose "dp" and "tp" slices hold this rank's stage's replicas."""
    train = train or TrainConfig()
    check_parallel(model, rt.world_size, rt.tp, cfg, precision)
    if rt.tp > 1:
        mesh = mesh or build_mesh(rt)
        TP_PLANS[str(getattr(model, "family", None))](
            model, mesh["tp"], cfg.sequence_parallel, loss_parallel
        )
    apply_ac(model, train.activation_checkpointing, train.ac_every)
    if train.compile:
        apply_compile(model)
    replicated = rt.dp_size == 1 or cfg.strategy in ("ddp", "zero1")
    if not replicated:
        mesh = mesh or build_mesh(rt)
        dp_mesh = mesh["dp"] if mesh.ndim > 1 else mesh
        apply_fsdp(model, dp_mesh, cfg.strategy != "zero2", mixed_precision_policy(precision))
    if materialize is not None:
        materialize(model)
    if rt.dp_size > 1 and cfg.strategy in ("ddp", "zero1") and data_parallel:
        group = mesh["dp"].get_group() if mesh is not None and mesh.ndim > 1 else None
        return apply_ddp(model, rt, cfg, group)
    return model  # data_parallel=False: the caller reduces gradients itself (privacy.dp_sgd)


def shard_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime, cfg: ParallelConfig
) -> torch.optim.Optimizer:
    """zero1: rebuild `optimizer` as a ZeroRedundancyOptimizer of the same class and settings,
    so each rank keeps the state of 1/world of the parameters (Rajbhandari et al. 2020)."""
    if cfg.strategy != "zero1" or rt.dp_size == 1:
        return optimizer
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    # Groups keep their own settings (e.g. no weight decay on norms, biases, embeddings).
    groups = [
        {
            **{k: v for k, v in g.items() if k in accepted and k != "params"},
            "params": list(g["params"]),
        }
        for g in optimizer.param_groups
    ]
    # Bucket views: each rank's parameters live in one flat buffer, so the step ends with one
    # broadcast per rank instead of one per parameter tensor (gpt-tiny, 36 tensors, on 2 gloo
    # processes: 40 ms a step with per-tensor broadcasts, 16 ms as DDP; see plan/comm.py).
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), parameters_as_bucket_view=True, **settings
    )


def grad_scaler(precision: Precision, cfg: ParallelConfig, rt: Runtime) -> torch.amp.GradScaler:
    """fp16 loss scaling; under sharding the inf/nan check must see every rank's shard."""
    if precision.name == "fp16" and rt.distributed and (cfg.strategy in SHARDED or rt.tp > 1):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(precision.device_type)
    return precision.make_scaler()


def loss_context(model: nn.Module) -> AbstractContextManager[None]:
    """`loss_parallel()` when the model's logits are vocabulary-sharded (see `apply_tp`): the
    loss and its backward must both run inside it."""
    if getattr(unwrap(model), "loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss-parallel loss) as the plain tensor every rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def no_sync(
    model: nn.Module, skip: bool, accum_reduce: str = "step"
) -> AbstractContextManager[None]:
    """Skip the gradient reduction on micro-batches that are not the last of an accumulation:
    DDP's all-reduce (no_sync) and FSDP2's reduce-scatter (set_requires_gradient_sync), whose
    unsharded gradients then accumulate locally until the last micro-batch. With
    `accum_reduce="micro_batch"` FSDP2 reduce-scatters every micro-batch instead and
    accumulates the sharded gradients (parallel.accum_reduce)."""
    if skip and isinstance(model, DDP):
        return model.no_sync()  # type: ignore[no-any-return]
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(not skip or accum_reduce == "micro_batch")
    return nullcontext()


FSDP_WAITS = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
"""FSDP2 parameter-group methods in which a rank waits for the others: the parameter
all-gather (forward, and backward under zero3) and the gradient reduce-scatter."""


def wrap_fsdp_waits(
    model: nn.Module, around: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None] | None:
    """Replace, on every FSDP2 unit of `model`, the methods that wait for other ranks
    (`FSDP_WAITS`) with `around(method)`; returns the function that puts them back. Straggler
    detection subtracts that time: a fast rank waiting in FSDP's collectives for a slow one
    must not look slow itself. FSDP2 has no public hook there; the parameter groups are
    reached through its state (torch 2.11-2.13: `_fsdp_param_groups`, or `_fsdp_param_group`).
    None when `model` has no FSDP2 unit."""
    undo: list[Callable[[], None]] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for group in groups:
            for name in FSDP_WAITS:
                if name in vars(group) or not hasattr(group, name):
                    continue  # wrapped already, or not in this torch
                setattr(group, name, around(getattr(group, name)))
                undo.append(partial(delattr, group, name))
    if not undo:
        return None

    def restore() -> None:
        for u in undo:
            u()

    return restore


def wrap_dtensor_waits(
    model: nn.Module, around: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None] | None:
    """Replace the function through which DTensor's collectives (tensor parallelism's
    all-reduces, all-gathers and reduce-scatters in forward and backward, as functional
    collectives) are waited for, `torch.distributed._functional_collectives.wait_tensor`,
    with `around(it)`; returns the function that puts it back. None when `model` has no
    DTensor parameter. Eager waits of an `AsyncCollectiveTensor` all go through that module
    global (torch 2.11-2.13); there is no public hook."""
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    from torch.distributed import _functional_collectives as funcol

    original = funcol.wait_tensor
    funcol.wait_tensor = around(original)

    def restore() -> None:
        funcol.wait_tensor = original

    return restore


def _grad_groups(model: nn.Module) -> list[list[torch.Tensor]]:
    """The gradients of `model` grouped by placement: plain tensors, and DTensors per
    (mesh, placements), so that each group's norm is one reduction."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    return list(groups.values())


@torch.no_grad()
def grad_norm(model: nn.Module) -> torch.Tensor:
    """The global L2 norm of the gradients over plain tensors and DTensors on any mesh (TP,
    FSDP, both), the same value on every rank and on the device (no host sync): a sharded
    group's norm is reduced across its mesh first (one all-reduce of a scalar per group).
    Replicated gradients (DDP, ZeRO-1, a TP model's norms) count once, as every rank holds
    them whole. A NaN/Inf in any rank's shard makes it non-finite on every rank. Under
    pipeline parallelism the stages' squares are summed over the pipeline's ranks."""
    squares = []
    for group in _grad_groups(model):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    pipeline = getattr(unwrap(model), "pipeline_group", None)
    if pipeline is not None:  # every stage joins, with or without gradients
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pipeline)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(
    model: nn.Module, max_norm: float, norm: torch.Tensor | None = None
) -> torch.Tensor:
    """Clip the global gradient norm (`grad_norm`, or `norm` when the caller has it already)
    to `max_norm`; returns the norm before clipping."""
    total = grad_norm(model) if norm is None else norm
    # A tensor coefficient (as torch.nn.utils.clip_grad_norm_ does): no host sync per step.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in _grad_groups(model):
        torch._foreach_mul_(group, coef.to(group[0].device))
    return total


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded model on CPU under its plain parameter names, on rank 0 (other
    ranks get an empty dict). Every rank must call it: gathering shards is a collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


def _fqn_order(model: nn.Module) -> list[str]:
    return list(get_model_state_dict(model).keys())


def _drop_frozen(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """Frozen parameters (a fine-tuning run's base) are not saved: the base export holds them.
    Every name of a tied parameter goes (StateDictOptions(ignore_frozen_params) keeps the
    second name of a tied pair, e.g. gpt's lm_head.weight)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            for fqn in _get_fqns(model, name):
                model_sd.pop(fqn, None)
    return model_sd


def _has_frozen(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state dicts for torch.distributed.checkpoint, keyed by parameter name
    so that any strategy and world size can read them.

    ZeroRedundancyOptimizer has no such form of its own: each rank contributes the state of the
    parameters it owns, and the param groups list every parameter, exactly as a replicated
    optimizer's state dict would, so DCP assembles the whole optimizer across ranks.
    """
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return _drop_frozen(model, model_sd), optim_sd
    local = cast(dict[str, Any], get_optimizer_state_dict(model, optimizer.optim))
    owned: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(owned, [g["params"] for g in local["param_groups"]])
    order = {name: i for i, name in enumerate(_fqn_order(model))}
    groups = []
    for i, group in enumerate(local["param_groups"]):
        names = {n for rank_groups in owned for n in rank_groups[i]}
        # The wrapper's groups hold the current lr (schedulers set it there; the local
        # optimizer sees it only at its next step).
        current = {k: v for k, v in optimizer.param_groups[i].items() if k != "params"}
        ordered = sorted(names, key=lambda n: order.get(n, len(order)))
        groups.append({**group, **current, "params": ordered})
    return _drop_frozen(model, get_model_state_dict(model)), {
        "state": local["state"],
        "param_groups": groups,
    }


def load_checkpoint_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
) -> None:
    """Load what `checkpoint_state` shaped (after DCP filled it) into model and optimizer."""
    options = StateDictOptions(strict=not _has_frozen(model))  # frozen: not in the checkpoint
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        set_state_dict(
            model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )
        return
    set_model_state_dict(model, model_sd, options=options)
    local = cast(dict[str, Any], get_optimizer_state_dict(model, optimizer.optim))
    local_groups = local["param_groups"]
    groups = [
        {**loaded, "params": mine["params"]}
        for loaded, mine in zip(optim_sd["param_groups"], local_groups, strict=True)
    ]
    loaded_sd: Any = {"state": optim_sd["state"], "param_groups": groups}
    set_optimizer_state_dict(model, optimizer.optim, loaded_sd)
    # The wrapper keeps its own copy of the param groups (lr, betas); refresh it.
    for outer, inner in zip(optimizer.param_groups, optimizer.optim.param_groups, strict=True):
        outer.update({k: v for k, v in inner.items() if k != "params"})


def reshard(model: nn.Module) -> None:
    """Free FSDP's gathered parameters (the root keeps them after forward) so that what is
    held is the shards alone."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_checkpoint_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer state held on this rank (what its checkpoint writes),
    as they are now (no resharding)."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for state in getattr(optimizer, "optim", optimizer).state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    local = [getattr(t, "_local_tensor", t) for t in tensors]
    return sum(int(t.numel() * t.element_size()) for t in local)


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (its local shards)."""
    reshard(model)

    def nbytes(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", t)  # DTensor shards count what is local
        if _is_quantized(local):
            # a torchao int8 or nf4 tensor (finetune.base_dtype): its data, scales and tables
            names = local.__tensor_flatten__()[0]  # type: ignore[union-attr]
            return sum(nbytes(getattr(local, n)) for n in names)
        return int(local.numel() * local.element_size())

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    # ZeroRedundancyOptimizer holds this rank's partition in its local optimizer.
    held = getattr(optimizer, "optim", optimizer)
    for state in held.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                opt += nbytes(v)
    return {
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": opt,
        "model_states_bytes": params + grads + opt,
    }
