"""`hpcml plan memory --trace CONFIG`: one training step of a run config traced on fake tensors.

The config is resolved as `hpcml train` resolves it (the data's input shape and classes, the
model's completed arguments, the layout checks), the model is built as training builds it
(activation checkpointing, channels-last), the optimizer is training's own (`build_optimizer`,
fused where torch has the kernel), and each micro-batch runs under the configured autocast; then
`hpcml.models.memtrace` traces one steady step under torch's MemTracker. Nothing is allocated.

Layouts traced: one process; ddp on any number (every DDP rank holds the whole model and its
own micro-batch; hpcml's DDP reduces gradients in their buckets' place,
`gradient_as_bucket_view`, so a rank holds no second copy); zero2 and zero3 (FSDP2, applied as
training applies it, over torch's fake process group of N ranks in this one process, traced by
FSDPMemTracker). zero1 (torch's ZeroRedundancyOptimizer) and tensor parallelism are refused:
their per-rank bytes come from the formula path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.distributed.precision import Precision
from hpcml.distributed.wrapping import apply_ac, apply_fsdp, mixed_precision_policy
from hpcml.errors import ConfigError, ModelError
from hpcml.models.memtrace import Batch, trace_step
from hpcml.models.zoo import build_model, count_parameters
from hpcml.train.losses import resolve_loss
from hpcml.train.schedule import build_optimizer, param_groups
from hpcml.train.validate import Resolved, resolve


def check_traceable(cfg: RunConfig, devices: int) -> None:
    p = cfg.parallel
    if p.tp > 1 or (p.strategy == "zero1" and devices > 1):
        raise ConfigError(
            f"--trace follows one-process, ddp, zero2 and zero3 (FSDP2) layouts; "
            f"parallel.strategy {p.strategy} with tp={p.tp} on {devices} devices is planned "
            "without --trace (the formula path)."
        )
    if cfg.finetune.method != "full":
        raise ConfigError(
            f"--trace follows full training; finetune.method {cfg.finetune.method} is planned "
            "without --trace."
        )


def trace_config(cfg: RunConfig, devices: int) -> dict[str, Any]:
    """Per-rank bytes of one steady training step of `cfg` on `devices` ranks, traced."""
    check_traceable(cfg, devices)
    res = resolve(cfg, devices)
    try:
        return trace_resolved(cfg, res, devices)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as exc:
        # A model whose forward needs real data (a value read on the host, a custom kernel
        # without a fake implementation) cannot be traced; say so instead of a traceback.
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ModelError(
            f"model {cfg.model.name!r} cannot be traced on fake tensors ({reason}); plan it "
            "without --trace, by its shape."
        ) from None


def trace_resolved(cfg: RunConfig, res: Resolved, devices: int) -> dict[str, Any]:
    """The trace of one replica's step for a config already resolved (as a run has it)."""
    splits, accum = res.splits, res.grad_accum
    micro = cfg.data.batch_size

    def build() -> nn.Module:
        model = build_model(cfg.model.name, res.model_args)
        apply_ac(model, cfg.train.activation_checkpointing, cfg.train.ac_every)
        if cfg.train.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        return model.train()

    def batches() -> list[Batch]:
        out = []
        for _ in range(accum):
            if splits.input_dtype.startswith("int"):
                x = torch.zeros((micro, *splits.input_shape), dtype=torch.int64)
            else:
                x = torch.empty((micro, *splits.input_shape))
                if cfg.train.channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
            out.append((x, torch.zeros((micro, *splits.target_shape), dtype=torch.int64)))
        return out

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(param_groups(model, cfg.optim), cfg.optim, devices)

    x, y = batches()[0]
    batch_bytes = x.numel() * x.element_size() + y.numel() * y.element_size()
    sharded = cfg.parallel.strategy in ("zero2", "zero3", "fsdp") and devices > 1
    # DDP's buckets hold every gradient (gradient_as_bucket_view) through zero_grad.
    keep_grads = cfg.parallel.strategy in ("ddp", "zero1") and devices > 1
    with fake_process_group(devices) if sharded else nullcontext() as mesh:
        traced = trace_step(
            build,
            optimizer,
            batches,
            resolve_loss(cfg.train.loss),
            # FSDP2's mixed-precision policy casts the gathered parameters itself.
            nullcontext if sharded else Precision(cfg.precision, "cpu").autocast,
            shard=(lambda m: shard_like_training(cfg, m, mesh)) if sharded else None,
            keep_grads=keep_grads,
        )
    return {
        "model": cfg.model.name,
        "parameters": count_parameters(res.meta_model),
        "model_args": res.model_args,
        "input_shape": list(splits.input_shape),
        "micro_batch": micro,
        "grad_accum": accum,
        "precision": cfg.precision,
        "optimizer": cfg.optim.name,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "strategy": cfg.parallel.strategy if devices > 1 else "single",
        "devices": devices,
        **traced.to_dict(),
        # What a run's probe counts (hpcml.train.memprobe): every storage autograd saves, and
        # the first layer saves the batch (an embedding its ids), the loss the targets.
        "activations_bytes_per_sample": (traced.activation_peak_bytes + batch_bytes) / micro,
    }


@contextmanager
def fake_process_group(devices: int) -> Iterator[Any]:
    """torch's fake process group of `devices` ranks in this one process (collectives are
    no-ops with the right shapes), and a CPU device mesh over it; torn down after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("--trace of a sharded layout needs a process of its own; run it alone.")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=devices)
    try:
        yield init_device_mesh("cpu", (devices,))
    finally:
        dist.destroy_process_group()


def shard_like_training(cfg: RunConfig, model: nn.Module, mesh: Any) -> None:
    """FSDP2 as hpcml.distributed.parallel applies it: per unit, then the root."""
    reshard = cfg.parallel.strategy != "zero2"
    apply_fsdp(model, mesh, reshard, mixed_precision_policy(cfg.precision))


def summary_trace(cfg: RunConfig, res: Resolved, world_size: int) -> dict[str, Any] | None:
    """For a run's summary.json: the traced step of the run's own config, so that its
    prediction takes its activations (and, where it traced the run's layout, its peak) from
    it. train.plan_trace `auto` takes it from the per-user cache (hpcml.train.trace_cache)
    when the same step was traced before, else traces and stores it; `always` traces afresh;
    `never`: None. A ddp run is traced on its own number of devices (every rank holds the
    whole model and DDP's gradient buckets); a sharded one as one replica, whose activations
    per sample do not depend on how the model states are sharded (its world needs a process
    group of its own)."""
    import time

    from hpcml.train import trace_cache

    mode = cfg.train.plan_trace
    if mode == "never":
        return None
    if cfg.finetune.method != "full" or cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        return None
    devices = world_size if cfg.parallel.strategy == "ddp" else 1
    t0 = time.process_time()
    try:
        key = trace_cache.trace_key(cfg, res, devices)
        traced = trace_cache.load(key) if mode == "auto" else None
        source = "cache" if traced is not None else "traced"
        if traced is None:
            traced = trace_resolved(cfg, res, devices)
            trace_cache.store(key, traced)
    except Exception as exc:  # a prediction must never fail a finished run
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    cpu_s = round(time.process_time() - t0, 4)
    return {**traced, "world_size": world_size, "source": source, "cpu_s": cpu_s}
