"""The exported-model format shared by training (writer) and serving (reader).

An export folder holds `model.safetensors` (the full, unsharded state dict) and `model.json`:

    {"format": "hpcml-export/1", "architecture": "simple_cnn", "args": {...},
     "input":  {"name": "input",  "shape": [3, 32, 32], "dtype": "float32"},
     "output": {"name": "logits", "shape": [10],        "dtype": "float32"},
     "task": "classification", "metadata": {...}}

Shapes are per sample; the batch axis is implicit and dynamic.

A model file is data, possibly written by someone else (a shared registry): its architecture
must be a zoo name. An import path (`pkg.mod:build`) would run that code, so `load_export` and
`check_architecture` refuse it unless the caller passes `trust_code=True` (`--trust-code`).
Weights are safetensors, which hold tensors only; with `encryption` in the run config they
are sealed with AES-GCM (hpcml.crypt) and read back with the key from the environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcml import crypt
from hpcml.errors import ModelError

FORMAT = "hpcml-export/1"
WEIGHTS = "model.safetensors"
META = "model.json"


def save_export(
    out_dir: Path,
    model: nn.Module,
    architecture: str,
    args: dict[str, Any],
    input_shape: tuple[int, ...],
    output_shape: tuple[int, ...],
    input_dtype: str = "float32",
    task: str = "classification",
    metadata: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
    key: crypt.Key | None = None,
) -> Path:
    """`state` is the full state dict when the model is sharded (FSDP, tensor parallel), where
    `model.state_dict()` would hold this rank's shards only. With `key` the weights file is
    sealed (hpcml.crypt); model.json stays readable."""
    from safetensors.torch import save, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    source = state if state is not None else model.state_dict()
    # safetensors refuses shared storage (tied weights); clone makes every tensor its own.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in source.items()}
    tmp = out_dir / (WEIGHTS + ".tmp")
    header = {"format": FORMAT, "architecture": architecture}
    if key is None:
        save_file(state, str(tmp), metadata=header)
    else:
        crypt.write_sealed(tmp, save(state, metadata=header), key)
    tmp.replace(out_dir / WEIGHTS)
    meta = {
        "format": FORMAT,
        "architecture": architecture,
        "args": args,
        "input": {"name": "input", "shape": list(input_shape), "dtype": input_dtype},
        "output": {"name": "logits", "shape": list(output_shape), "dtype": "float32"},
        "task": task,
        "metadata": metadata or {},
    }
    tmpm = out_dir / (META + ".tmp")
    tmpm.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    tmpm.replace(out_dir / META)
    return out_dir


def read_export_meta(export_dir: Path) -> dict[str, Any]:
    meta_path = export_dir / META
    if not meta_path.exists():
        raise ModelError(
            f"{export_dir} is not an hpcml export: {META} is missing; point at a run's export/ folder."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"{meta_path} is not valid JSON; re-export the model.") from None
    if not isinstance(meta, dict):
        raise ModelError(f"{meta_path} must hold a JSON object; re-export the model.")
    return meta


def check_architecture(meta: dict[str, Any], export_dir: Path, trust_code: bool = False) -> str:
    """The architecture named in `meta`, refused (one sentence) unless it may be built.

    Checked before anything is imported or built, so a hostile model.json runs nothing.
    """
    from hpcml.models.zoo import UntrustedCode, get_spec, is_import_path

    where = Path(export_dir) / META
    arch = meta.get("architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{where} names no architecture (a zoo model name); re-export the model.")
    if not isinstance(meta.get("args") or {}, dict):
        raise ModelError(f"{where}: 'args' must be a mapping of builder arguments; re-export.")
    if is_import_path(arch):
        if not trust_code:
            raise UntrustedCode(
                f"{where} names architecture '{arch}', an import path, and hpcml runs code named "
                "by a model file only with --trust-code; pass it only if you trust whoever "
                "wrote that file."
            )
        return arch
    get_spec(arch, trust_code=False)  # an unknown zoo name is refused with the known names
    return arch


def load_export(
    export_dir: Path, device: str = "cpu", trust_code: bool = False
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the architecture named in model.json and load its weights; eval mode.

    `trust_code=True` lets an import path in model.json run (see `check_architecture`)."""
    from safetensors.torch import load, load_file

    from hpcml.models.zoo import build_model

    export_dir = Path(export_dir)
    if (export_dir / "export" / META).exists():
        export_dir = export_dir / "export"
    meta = read_export_meta(export_dir)
    arch = check_architecture(meta, export_dir, trust_code)
    weights = export_dir / WEIGHTS
    if not weights.exists():
        raise ModelError(f"{weights} is missing; the export is incomplete, re-export the model.")
    model = build_model(arch, meta.get("args") or {}, trust_code=trust_code)
    sealed = crypt.file_is_sealed(weights)
    # Decrypted in memory (key from the environment: the serving processes inherit it); a
    # missing or wrong key is its own sentence, before anything is loaded.
    plain = crypt.read_maybe_sealed(weights, None, "the exported weights") if sealed else None
    try:
        state = load(plain) if plain is not None else load_file(str(weights), device=device)
        model.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - any bad weights file is one user-facing problem
        raise ModelError(
            f"{weights} cannot be loaded into {meta['architecture']} ({type(exc).__name__}); "
            "the file is corrupt or from another architecture."
        ) from None
    model.to(device).eval()
    return model, meta


def check_weights_key(export_dir: Path) -> None:
    """Sealed weights need the key they were sealed with in the environment: checked here, in
    the server, before an inference process starts (one sentence, exit 2)."""
    weights = Path(export_dir) / WEIGHTS
    if not weights.is_file() or not crypt.file_is_sealed(weights):
        return
    key = crypt.key_from_env(required_for=f"the exported weights {weights}")
    assert key is not None
    with open(weights, "rb") as f:
        crypt.check_key(f.read(crypt.HEADER_BYTES), key, str(weights))


def example_input(meta: dict[str, Any], batch: int = 2) -> torch.Tensor:
    shape = (batch, *meta["input"]["shape"])
    dtype = meta["input"].get("dtype", "float32")
    if dtype.startswith("int"):
        return torch.zeros(shape, dtype=getattr(torch, dtype))
    return torch.randn(shape)
