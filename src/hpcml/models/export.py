"""The exported-model format shared by training (writer) and serving (reader).

An export folder holds `model.safetensors` (the full, unsharded state dict) and `model.json`:

    {"format": "hpcml-export/1", "architecture": "simple_cnn", "args": {...},
     "input":  {"name": "input",  "shape": [3, 32, 32], "dtype": "float32"},
     "output": {"name": "logits", "shape": [10],        "dtype": "float32"},
     "task": "classification", "metadata": {...}}

Shapes are per sample; the batch axis is implicit and dynamic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
) -> Path:
    """`state` is the full state dict when the model is sharded (FSDP, tensor parallel), where
    `model.state_dict()` would hold this rank's shards only."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    source = state if state is not None else model.state_dict()
    # safetensors refuses shared storage (tied weights); clone makes every tensor its own.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in source.items()}
    tmp = out_dir / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": FORMAT, "architecture": architecture})
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
        meta: dict[str, Any] = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        raise ModelError(f"{meta_path} is not valid JSON; re-export the model.") from None
    return meta


def load_export(export_dir: Path, device: str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Build the architecture named in model.json and load its weights; eval mode."""
    from safetensors.torch import load_file

    from hpcml.models.zoo import build_model

    export_dir = Path(export_dir)
    if (export_dir / "export" / META).exists():
        export_dir = export_dir / "export"
    meta = read_export_meta(export_dir)
    weights = export_dir / WEIGHTS
    if not weights.exists():
        raise ModelError(f"{weights} is missing; the export is incomplete, re-export the model.")
    model = build_model(meta["architecture"], meta.get("args") or {})
    try:
        state = load_file(str(weights), device=device)
        model.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - any bad weights file is one user-facing problem
        raise ModelError(
            f"{weights} cannot be loaded into {meta['architecture']} ({type(exc).__name__}); "
            "the file is corrupt or from another architecture."
        ) from None
    model.to(device).eval()
    return model, meta


def example_input(meta: dict[str, Any], batch: int = 2) -> torch.Tensor:
    shape = (batch, *meta["input"]["shape"])
    dtype = meta["input"].get("dtype", "float32")
    if dtype.startswith("int"):
        return torch.zeros(shape, dtype=getattr(torch, dtype))
    return torch.randn(shape)
