"""The whole resolved config checked without a process group and without materializing the model.

`hpcml train --nproc N` runs `resolve` in the parent before torchrun starts, so the common
mistakes (a tp that does not divide the heads, a batch larger than the data, a typo in
`model.args`, a missing data folder, an eval set smaller than the ranks) end as one sentence,
exit 2, before any worker exists. Every worker runs it again first thing (an external torchrun
has no parent of ours): it is deterministic, so all ranks raise the same error before the first
collective and no rank is left waiting in one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.data.sources import Splits, load_source
from hpcml.distributed import meta_init
from hpcml.distributed.parallel import check_parallel
from hpcml.distributed.pipeline import check_pipeline
from hpcml.errors import ConfigError, DataError, ModelError
from hpcml.models.zoo import build_model, complete_args, forward_flops_per_sample, get_spec
from hpcml.train import eval_sets, finetune, pipeline, privacy


@dataclass
class Resolved:
    splits: Splits
    model_args: dict[str, Any]
    meta_model: nn.Module
    """The model built on the meta device: shapes and parameter names, no storage."""
    world_size: int
    dp_size: int
    grad_accum: int
    """Micro-batches per optimizer step: train.grad_accum, or derived from train.global_batch."""
    init_from: Path | None = None
    """The folder of the export `model.init_from` names, checked against the model."""
    eval_sets: dict[str, Splits] = field(default_factory=dict)
    """The validation splits `train.eval_sets` names (`hpcml.train.eval_sets`)."""
    base_ref: dict[str, Any] | None = None
    """`model.init_from` as a registry URI: the URI, model name and version it resolved to."""


def resolve(cfg: RunConfig, world_size: int) -> Resolved:
    """Load the data's description, build the model on meta and check the layout; raises an
    `HpcmlError` with one sentence for the first problem found."""
    get_spec(cfg.model.name)
    check_synthetic_memory(cfg)
    splits = load_source(cfg.data)
    model_args = complete_args(
        cfg.model.name, cfg.model.args, splits.input_shape, splits.num_classes
    )
    with torch.device("meta"):
        model = build_model(cfg.model.name, model_args)
    # DP-SGD's own refusal first: it names the setting Opacus cannot train with.
    privacy.check(cfg, model, cfg.train.grad_accum)
    # The layout first: a model that cannot be split over tp ranks is the more specific sentence.
    check_parallel(model, world_size, cfg.parallel.tp, cfg.parallel, cfg.precision)
    check_pipeline(model, world_size, cfg.parallel, cfg.data.batch_size)
    pipeline.check_run(cfg)
    check_forward(cfg, model, splits)
    dp_size = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    check_batch(cfg, splits, dp_size)
    check_loss(cfg)
    check_augment(cfg)
    grad_accum = derive_grad_accum(cfg, dp_size)
    privacy.check(cfg, model, grad_accum)  # train.global_batch may ask for micro-batches
    base_ref = finetune.resolve_registry_base(cfg)  # models:/NAME@ALIAS -> its export folder
    init_from = check_init_from(base_ref["path"] if base_ref else cfg.model.init_from, model)
    finetune.check(cfg, model, world_size)  # needs init_from, targets that match
    sets = eval_sets.load(cfg, splits)  # train.eval_sets
    return Resolved(
        splits, model_args, model, world_size, dp_size, grad_accum, init_from, sets, base_ref
    )


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return None


def check_synthetic_memory(cfg: RunConfig) -> None:
    """data.source synthetic generates the whole set at once and then copies it into the two
    splits: refuse a set that cannot fit in this machine's memory twice."""
    d = cfg.data
    if d.source != "synthetic":
        return
    need = 2 * d.synthetic_samples * (math.prod(d.synthetic_shape) * 4 + 8)  # float32 x, int64 y
    have = physical_memory_bytes()
    if have is not None and need > have:
        raise DataError(
            f"data.synthetic_samples {d.synthetic_samples} of shape {d.synthetic_shape} need "
            f"{need / 2**30:,.1f} GiB to generate and split, more than this machine's "
            f"{have / 2**30:,.1f} GiB of memory; lower data.synthetic_samples or the shape."
        )


def check_forward(cfg: RunConfig, model: nn.Module, splits: Splits) -> None:
    """One forward of a batch of 2 on the meta device (what set-up counts FLOPs with): a model
    that cannot take the data's inputs is refused here, not by a worker's traceback."""
    if not meta_init.initializable(model):
        return  # built on the device later; its forward may not run on meta
    try:
        forward_flops_per_sample(model, splits.input_shape, splits.input_dtype, device="meta")
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ModelError(
            f"model {cfg.model.name!r} cannot take the inputs of data.source "
            f"'{cfg.data.source}' (one sample of shape {list(splits.input_shape)}, "
            f"{splits.input_dtype}): {reason}; choose model.args or data settings that fit."
        ) from None


def derive_grad_accum(cfg: RunConfig, dp_size: int) -> int:
    """train.grad_accum, or global_batch / (batch_size x dp_size) when train.global_batch is set."""
    t, batch = cfg.train, cfg.data.batch_size
    if t.global_batch is None:
        return t.grad_accum
    per_step = batch * dp_size
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch {t.global_batch} is not a multiple of data.batch_size {batch} x "
            f"{dp_size} data-parallel processes ({per_step}); choose a global_batch that "
            "divides evenly, or change data.batch_size or the number of processes."
        )
    accum = t.global_batch // per_step
    if t.grad_accum not in (1, accum):
        raise ConfigError(
            f"train.grad_accum {t.grad_accum} contradicts train.global_batch {t.global_batch} "
            f"(which gives {accum} on {dp_size} data-parallel processes of data.batch_size "
            f"{batch}); set only one of them."
        )
    return accum


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system (Python 3.11 raises it): no file
        return False


def check_init_from(path: str | None, model: nn.Module) -> Path | None:
    """The export folder `model.init_from` names, after checking (from the safetensors header,
    nothing loaded) that it holds every parameter and buffer of `model` with the same shape."""
    if path is None:
        return None
    from safetensors import safe_open

    from hpcml.models.export import WEIGHTS

    given = Path(path).expanduser()
    candidates = (
        [given]
        if given.suffix == ".safetensors"
        else [
            given / WEIGHTS,
            given / "export" / WEIGHTS,
        ]
    )
    found = next((c for c in candidates if _is_file(c)), None)
    if found is None:
        raise ConfigError(
            f"model.init_from {str(path)!r}: no {WEIGHTS} there (nor in its export/ folder); point it "
            "at a finished run folder, its export/ folder or the model.safetensors file."
        )
    try:
        with safe_open(str(found), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one user-facing problem
        raise ModelError(
            f"model.init_from {found} is not a readable safetensors file "
            f"({type(exc).__name__}); re-export the model."
        ) from None
    for name, t in [*model.state_dict().items()]:
        if name not in shapes:
            raise ModelError(
                f"model.init_from {found} has no tensor '{name}', which this model needs; point "
                "it at an export of the same architecture (model.name and model.args)."
            )
        if shapes[name] != tuple(t.shape):
            raise ModelError(
                f"model.init_from {found}: '{name}' has shape {list(shapes[name])} there but "
                f"{list(t.shape)} in this model; use the model.args the export was made with."
            )
    return found.parent


def train_samples_per_replica(splits: Splits, dp_size: int, seed: int) -> int:
    make_sampler = getattr(splits.train, "make_sampler", None)
    if make_sampler is not None:
        return len(make_sampler(0, dp_size, seed))
    return len(splits.train) // dp_size  # type: ignore[arg-type]


def check_batch(cfg: RunConfig, splits: Splits, dp_size: int) -> None:
    per_replica = train_samples_per_replica(splits, dp_size, cfg.train.seed)
    if per_replica < cfg.data.batch_size:
        total = per_replica * dp_size
        raise DataError(
            f"data.batch_size {cfg.data.batch_size} x {dp_size} data-parallel processes is "
            f"larger than the {total} training samples of data.source '{cfg.data.source}'; "
            "lower data.batch_size or use more data."
        )
    n_val = len(splits.val)  # type: ignore[arg-type]
    if n_val < dp_size:
        raise DataError(
            f"data.source '{cfg.data.source}' has {n_val} validation samples, fewer than the "
            f"{dp_size} data-parallel processes that each evaluate a share; raise "
            "data.val_fraction (or data.eval_windows) or start fewer processes."
        )


AUGMENTED_SOURCES = ("digits", "cifar10", "shards of images")


def _is_image_source(cfg: RunConfig) -> bool:
    if cfg.data.source in ("digits", "cifar10"):
        return True
    if cfg.data.source != "shards":
        return False
    from hpcml.data.shards import read_manifest
    from hpcml.data.shards.convert import check_shards, is_image_set

    return is_image_set(read_manifest(check_shards(cfg.data)))


def check_augment(cfg: RunConfig) -> None:
    """`data.augment` (random crop + flip) exists for the image sources only; elsewhere it would
    silently do nothing."""
    if cfg.data.augment and not _is_image_source(cfg):
        raise ConfigError(
            f"data.augment applies to the image sources ({', '.join(AUGMENTED_SOURCES)}), not to "
            f"data.source '{cfg.data.source}' at {cfg.data.path}; remove data.augment."
            if cfg.data.source == "shards"
            else f"data.augment applies to the image sources ({', '.join(AUGMENTED_SOURCES)}), "
            f"not to data.source '{cfg.data.source}'; remove data.augment."
        )
    d = cfg.data
    if d.augment_on == "device" and not d.augment:
        raise ConfigError(
            "data.augment_on: device says where data.augment runs, but data.augment is off; "
            "set data.augment=true or remove data.augment_on."
        )
    if (d.mixup_alpha > 0 or d.cutmix_alpha > 0) and d.augment_on != "device":
        raise ConfigError(
            "data.mixup_alpha and data.cutmix_alpha run on the device only; set "
            "data.augment=true and data.augment_on=device, or set both alphas to 0."
        )


def check_loss(cfg: RunConfig) -> None:
    """`train.loss` names a known loss or an importable callable (resolved again per worker)."""
    from hpcml.train.losses import resolve_loss

    resolve_loss(cfg.train.loss)
