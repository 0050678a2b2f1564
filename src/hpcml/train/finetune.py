"""Fine-tuning from an export (`finetune:`): LoRA through Hugging Face PEFT, or the output layer
alone, on a frozen base that `model.init_from` names.

The model is built on the CPU, the base export loaded whole (it is never written), adapters
injected (`hpcml.models.lora`) and everything else frozen; then it is parallelized like any
model (DDP all-reduces only the gradients of the trainable parameters; FSDP2 shards frozen and
trainable ones alike). The optimizer sees only the trainable parameters (`param_groups`), and
checkpoints hold only them and their optimizer state (`checkpoint_state` leaves frozen
parameters out), plus the base export's sha256: a resume against another base is refused.
The run's export holds the merged weights (an ordinary export `hpcml serve` loads);
`finetune.export_adapter` adds the adapter alone under `export/adapter/`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.distributed.parallel import SHARDED
from hpcml.errors import CheckpointError, ConfigError, ModelError
from hpcml.models import lora, quant
from hpcml.models.export import WEIGHTS
from hpcml.models.zoo import build_model, count_parameters, forward_flops_per_sample

SHA_KEY = "finetune_base_sha256"
_sha_cache: dict[tuple[str, int, int], str] = {}


def active(cfg: RunConfig) -> bool:
    return cfg.finetune.method != "full"


def lora_config_of(cfg: RunConfig, model: nn.Module) -> Any:
    f = cfg.finetune
    return lora.lora_config(f.r, f.alpha, f.dropout, f.target or lora.default_targets(model))


def check(cfg: RunConfig, meta_model: nn.Module, world_size: int = 1) -> None:
    """Refusals that need no weights, run by `validate.resolve` on every rank and the parent."""
    method = cfg.finetune.method
    if method != "lora" and cfg.finetune.base_dtype != "fp32":
        raise ConfigError(
            f"finetune.base_dtype {cfg.finetune.base_dtype} quantizes a frozen base under "
            f"adapters, but finetune.method is {method}; use finetune.method lora or "
            "finetune.base_dtype fp32."
        )
    if not active(cfg):
        return
    if cfg.model.init_from is None:
        raise ConfigError(
            f"finetune.method {method} needs a base to start from, and model.init_from is not "
            "set; point it at an hpcml export (a run folder, its export/ folder or its "
            "model.safetensors)."
        )
    if cfg.parallel.tp > 1:
        raise ConfigError(
            f"finetune.method {method} does not run under tensor parallelism (parallel.tp "
            f"{cfg.parallel.tp}); use parallel.tp 1 with ddp, zero1 or zero3."
        )
    if method == "lora":
        lora.check_targets(meta_model, lora_config_of(cfg, meta_model))
    if cfg.finetune.base_dtype == "nf4" and world_size > 1 and cfg.parallel.strategy in SHARDED:
        where = quant.nf4_unshardable(meta_model, world_size)
        if where is not None:
            raise ConfigError(
                f"finetune.base_dtype nf4 under parallel.strategy {cfg.parallel.strategy} shards "
                f"each quantized weight by rows and scales, and {world_size} processes do not "
                f"divide {where}; run a number of processes that divides both, or use parallel.strategy ddp."
            )
    if cfg.finetune.base_dtype == "int8" and world_size > 1:
        # torchao's int8 tensors implement no view/split: FSDP's sharding of the frozen base
        # fails inside torch (seen with torchao 0.18 on torch 2.13), as did DDP's broadcast
        # before apply_ddp left quantized weights out of it (int8 under DDP untested since).
        raise ConfigError(
            f"finetune.base_dtype int8 trains on one process, not {world_size}; run it with "
            "--nproc 1, or use finetune.base_dtype fp32 with ddp or zero3."
        )


def resolve_registry_base(cfg: RunConfig) -> dict[str, Any] | None:
    """`model.init_from: models:/NAME@ALIAS` (or `models:/NAME/VERSION`): the registered
    version's export folder, its files checked against the sha256 tagged at registration, read
    in place from a local artifact store (downloaded into a temporary folder from a remote one);
    None for a path. The registry is the one `tracking.uri` names."""
    uri = cfg.model.init_from
    if uri is None or not uri.startswith("models:/"):
        return None
    from hpcml.track.resolve import resolve_model

    found = resolve_model(uri, tracking_uri=cfg.tracking.uri)
    return {"uri": uri, "name": found.name, "version": found.version, "path": str(found.path)}


def base_sha256(folder: Path) -> str:
    """sha256 of the base export's weights file (cached by path, size and mtime)."""
    path = Path(folder) / WEIGHTS
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _sha_cache[key] = h.hexdigest()
    return _sha_cache[key]


def _last_layer(model: nn.Module) -> nn.Module:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    return linears[-1]


def prepare(cfg: RunConfig, model: nn.Module) -> nn.Module:
    """Freeze the base and add what trains: LoRA adapters, or the output layer unfrozen."""
    if cfg.finetune.method == "lora":
        if cfg.finetune.base_dtype != "fp32":  # QLoRA-style: frozen Linears held as int8/nf4
            quant.quantize_base(model, cfg.finetune.base_dtype)
        return lora.inject(model, lora_config_of(cfg, model), cfg.train.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in _last_layer(model).parameters():
        p.requires_grad_(True)
    return model


def load_base(cfg: RunConfig, model_args: dict[str, Any], folder: Path) -> nn.Module:
    """The base model on the CPU with the export's weights, read as tensors only."""
    from safetensors.torch import load_file

    model = build_model(cfg.model.name, model_args)
    try:
        model.load_state_dict(load_file(str(folder / WEIGHTS)), strict=True)
    except Exception as exc:  # noqa: BLE001 - any mismatch is one user-facing problem
        raise ModelError(
            f"model.init_from {folder} cannot be loaded into {cfg.model.name} "
            f"({type(exc).__name__}); point it at an export of the same model.name and "
            "model.args."
        ) from None
    return model


def build_finetune_model(cfg: RunConfig, rt: Any, res: Any) -> Any:
    """The `BuiltModel` of a fine-tuning run (see `hpcml.train.build`)."""
    from hpcml.distributed.parallel import parallelize
    from hpcml.train.build import BuiltModel

    assert res.init_from is not None  # check() refused a run without it
    model = prepare(cfg, load_base(cfg, res.model_args, res.init_from)).to(rt.device)
    splits = res.splits
    flops = forward_flops_per_sample(
        res.meta_model, splits.input_shape, splits.input_dtype, device="meta"
    )
    n_params = count_parameters(model)
    model = parallelize(
        model, rt, cfg.parallel, cfg.train, cfg.precision, None, cfg.train.loss == "cross_entropy"
    )
    return BuiltModel(model, n_params, flops, False)


def checkpoint_fields(cfg: RunConfig, res: Any) -> dict[str, Any]:
    """What a checkpoint's trainer state records of the base (nothing for a full run)."""
    if not active(cfg):
        return {}
    return {SHA_KEY: base_sha256(res.init_from), "finetune_method": cfg.finetune.method}


def check_resume(saved: dict[str, Any], cfg: RunConfig, res: Any, path: Path) -> None:
    """Refuse a checkpoint whose adapters were trained on another base export."""
    if not active(cfg):
        return
    want, have = saved.get(SHA_KEY), base_sha256(res.init_from)
    if want != have:
        raise CheckpointError(
            f"checkpoint {path} was trained on a base export with sha256 "
            f"{str(want)[:12]}... but model.init_from {res.init_from} has sha256 {have[:12]}...; "
            "resume with the base the run started from, or start a new --run-dir."
        )


def summary_block(cfg: RunConfig, model: nn.Module, res: Any) -> dict[str, Any]:
    """Trainable and total parameters (of the unwrapped model; FSDP's DTensors count whole)."""
    params = list(model.parameters())
    block: dict[str, Any] = {
        "method": cfg.finetune.method,
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "total_params": sum(p.numel() for p in params),
        "param_bytes": quant.weight_bytes(model),  # as held: int8 1 byte a weight, nf4 half
    }
    if active(cfg):
        block["base_dtype"] = cfg.finetune.base_dtype
        block["base"] = str(res.init_from)
        block["base_sha256"] = base_sha256(res.init_from)
    if res.base_ref is not None:  # model.init_from a registry URI: which version it was
        block["base_model"] = {k: res.base_ref[k] for k in ("uri", "name", "version")}
    return block


def export_weights(cfg: RunConfig, res: Any, weights: dict[str, torch.Tensor]) -> Any:
    """The weights the export holds: with LoRA, the base's names with the adapters merged."""
    if cfg.finetune.method != "lora":
        return weights
    build = lambda: build_model(cfg.model.name, res.model_args)  # noqa: E731
    fp32 = quant.dequantize_state(weights)  # base_dtype int8/nf4: the weights it trained on
    return lora.merged_state(build, lora_config_of(cfg, res.meta_model), fp32)


def write_adapter(
    export: Path, cfg: RunConfig, res: Any, weights: dict[str, torch.Tensor]
) -> Path | None:
    """With finetune.export_adapter (and LoRA): the adapter alone in export/adapter/."""
    if cfg.finetune.method != "lora" or not cfg.finetune.export_adapter:
        return None
    return lora.save_adapter(export / "adapter", lora_config_of(cfg, res.meta_model), weights)
