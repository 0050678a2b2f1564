"""Meta-device initialisation: a model built on `torch.device("meta")` and already parallelized
(TP, AC, compile, FSDP2) gets storage for its local shards only (`to_empty`), which are then
filled either by a seeded initialisation or from a full safetensors export.

Identical initial weights whatever the world size and strategy. Each parameter (and buffer) is
generated whole on the CPU from a generator seeded by (train.seed, its parameter name), one at
a time, and each rank keeps its own slice of it (`distribute_tensor(..., src_data_rank=None)`
slices locally, no communication); the full tensor is freed before the next one. So the extra
host memory of set-up is the largest single parameter, not the model. We do not use DTensor's
own random ops (`torch.distributed.tensor._random`): their offset-based generator, which makes a
shard equal the slice of the whole, exists for CUDA-like devices only (Philox offsets); on the
CPU every rank would draw its shard from its own stream and layouts would disagree.

Who decides the distribution: a model with an `init_parameter(name, tensor, generator)` method
(the `gpt` family) fills each parameter by name; otherwise each module that owns parameters is
re-initialised by its own `reset_parameters()` on a CPU twin (a copy of the module made while it
was still on meta), under a CPU RNG seeded by (seed, module name). A model with a module that
owns state but has no `reset_parameters` cannot be initialised this way (`initializable` says
so) and is built on the CPU as before.

`load_full_export` reads a full export (`export/model.safetensors`) into the sharded model with
torch.distributed.checkpoint's `HuggingFaceStorageReader`, which reads each rank's slice of each
tensor with safetensors' `get_slice`: no rank holds the whole model.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

_WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod"}


def clean_name(fqn: str) -> str:
    """A parameter's name as the plain model spells it (without the AC / compile wrappers; DDP
    wraps only after initialisation)."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPERS)


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), the same in every process and Python run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _owned(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]


def initializable(model: nn.Module) -> bool:
    """True when every module that owns state can be re-initialised after `to_empty`."""
    if callable(getattr(model, "init_parameter", None)):
        return not any(True for _ in model.buffers())  # init_parameter covers parameters only
    return all(callable(getattr(m, "reset_parameters", None)) for m in model.modules() if _owned(m))


def twins(model: nn.Module) -> dict[str, nn.Module]:
    """Meta copies of every module that owns state, by clean module name. Taken before
    parallelization changes the modules (FSDP, TP), while copying them costs no memory."""
    if callable(getattr(model, "init_parameter", None)):
        return {}
    return {
        (clean_name(n) + "." if n else ""): copy.deepcopy(m)
        for n, m in model.named_modules()
        if _owned(m)
    }


def _local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        full = full.to(like.device)
        return distribute_tensor(
            full, like.device_mesh, like.placements, src_data_rank=None
        )._local_tensor
    return full


def _assign(target: torch.Tensor, full: torch.Tensor) -> None:
    local = _local_slice(full, target)
    dest = target._local_tensor if isinstance(target, DTensor) else target
    dest.copy_(local)


def _unique_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:  # tied weights are initialised once
            seen.add(id(t))
            yield clean_name(name), t


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, module_twins: dict[str, nn.Module]) -> None:
    """Fill every parameter and buffer of a materialized (possibly sharded) model."""
    init_parameter = getattr(model, "init_parameter", None)
    if callable(init_parameter):
        for name, p in _unique_state(model):
            full = torch.empty(p.shape, dtype=p.dtype)
            init_parameter(name, full, torch.Generator().manual_seed(name_seed(seed, name)))
            _assign(p, full)
            del full
        return
    targets = dict(_unique_state(model))
    for mod_name, twin in module_twins.items():
        twin.to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, mod_name))
            twin.reset_parameters()  # type: ignore[operator]
        for attr, value in _owned(twin):
            target = targets.get(mod_name + attr)
            if target is not None:
                _assign(target, value)
        twin.to_empty(device="meta", recurse=False)  # free the CPU copy


def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    module_twins: dict[str, nn.Module],
    init_from: Path | None = None,
) -> None:
    """Give the local shards storage on `device`, then initialise or load them."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((m, attr))
    model.to_empty(device=device)
    # to_empty gives each attribute a tensor of its own: tie shared parameters again.
    for group in holders.values():
        first = getattr(group[0][0], group[0][1])
        for m, attr in group[1:]:
            setattr(m, attr, first)
    if init_from is not None:
        load_full_export(model, init_from)
    else:
        init_weights(model, seed, module_twins)


def load_full_export(model: nn.Module, folder: Path) -> None:
    """Load a folder holding a full `model.safetensors` into `model` (sharded or not), each rank
    reading only its slices. Every rank must call it (DCP plans the load together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from hpcml.distributed.dcp_safe import SafeLoadPlanner
    from hpcml.errors import ModelError

    state: dict[str, Any] = get_model_state_dict(model)
    try:  # a safetensors export holds tensors only; the planner refuses anything pickled
        dcp.load(
            state,
            storage_reader=HuggingFaceStorageReader(str(folder)),
            planner=SafeLoadPlanner(),
        )
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        first = str(exc).strip().splitlines()
        raise ModelError(
            f"model.init_from {folder} cannot be loaded into this model "
            f"({type(exc).__name__}: {(first[0] if first else '')[:200]}); point it at an export "
            "of the same architecture and model.args."
        ) from None
    set_model_state_dict(model, state)
