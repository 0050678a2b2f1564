"""Model-family-independent wrapping pieces: which submodules are the repeated "units" (blocks),
and the functions that apply activation checkpointing, torch.compile and FSDP2 to them.

Per-family plans (`parallelize_gpt`) call these in torchtitan's order: TP, AC, compile, FSDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def units(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of each repeated unit: a model's `blocks` ModuleList when it has
    one (gpt; a pipeline stage's ModuleDict of its blocks, keyed by their index in the whole
    model), else its top-level children that hold parameters (CNN stages, ResNet layers)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList | nn.ModuleDict):
        return [(blocks, name) for name, _ in blocks.named_children()]
    found: list[tuple[nn.Module, str]] = []
    for name, child in model.named_children():
        inner = [(sub, m) for sub, m in child.named_children() if _has_params(m)]
        # A Sequential of composite modules (stages, residual blocks) is a list of units; a
        # Sequential of plain layers (conv, norm, linear) is one unit.
        if isinstance(child, nn.Sequential) and any(_is_composite(m) for _, m in inner):
            found += [(child, sub) for sub, _ in inner]
        elif _has_params(child):
            found.append((model, name))
    return found


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _is_composite(m: nn.Module) -> bool:
    return any(True for _ in m.children())


def apply_ac(model: nn.Module, mode: str, every: int) -> int:
    """Recompute activations in backward (hpcml.plan.recompute's names): every unit (`full`),
    every K-th one from the first (`layer:K`; `selective` is layer:`every`), or every unit
    under torchtitan's op policy (`op`: saves the attention kernel's and every other matmul's
    outputs). Returns how many units were wrapped."""
    if mode == "none":
        return 0
    if mode.startswith("layer:"):
        every = int(mode.partition(":")[2])
    wrapped = 0
    for i, (parent, name) in enumerate(units(model)):
        if mode in ("full", "op") or i % every == 0:
            # Non-reentrant checkpointing composes with FSDP2, DTensor and compile; the wrapper's
            # state-dict hooks keep parameter names unchanged.
            unit = getattr(parent, name)
            if mode == "op":
                unit = checkpoint_wrapper(unit, context_fn=_op_policy_context)
            else:
                unit = checkpoint_wrapper(unit)
            setattr(parent, name, unit)
            wrapped += 1
    return wrapped


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
# torchtitan's save list (torchtitan/distributed/activation_checkpoint.py), with the CPU kernel
# of scaled_dot_product_attention and addmm (a Linear with a bias) beside mm.
_OP_SAVE = {
    *_MATMULS,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _op_policy_context() -> Any:
    """A fresh policy per checkpointed forward: save the kernels of `_OP_SAVE`, but only every
    other matmul (the 1st, 3rd, ... of the unit), and recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {False: 0, True: 0}  # forward, recomputation

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _OP_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile each unit in place (names unchanged); the whole model when it has no units.
    `backend`: torch.compile's (tests pick `aot_eager`, the same graph capture and autograd
    without inductor's C++ compile, which takes minutes on a busy CPU).
    Units, not one graph, also on one process: the step timer's module hooks on the model
    (hpcml.train.fault.straggler) must run outside compiled code, and compiling the whole model
    traced them (seen on an H100 with torch 2.11: CUDA events never recorded, the straggler
    check raised). Per unit, compile was 0.88x eager on gpt2-small and SimpleCNN ran at 0.51x
    a hand loop compiled whole there (benchmarks/results/gpu/README.md): not yet a speed-up."""
    found = units(model)
    if not found:
        model.compile(backend=backend)
        return
    for parent, name in found:
        getattr(parent, name).compile(backend=backend)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Low-precision compute with fp32 gradient reduction, so sums over many ranks stay exact."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy
) -> None:
    """FSDP2 per unit, then the root for the remaining parameters (embeddings, head)."""
    found = units(model)
    for i, (parent, name) in enumerate(found):
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        keep = reshard_after_forward and i < len(found) - 1
        fully_shard(
            getattr(parent, name), mesh=mesh, reshard_after_forward=keep, mp_policy=mp_policy
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
