"""An export described for MLflow, and its digest.

`mlmodel_for` writes the `MLmodel` file that makes the MLflow UI show an export as a model with
its tensor signature (inputs, outputs); it has an `hpcml` flavor and no pyfunc flavor, since a
pyfunc model is loaded by unpickling. `export_sha256` is the digest the registry tags a version
with and checks before serving it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import MlflowClient

MLMODEL = "MLmodel"
# Files MLflow writes beside a model; they describe it and are not part of what is served.
_NOT_DIGESTED = {MLMODEL, "conda.yaml", "python_env.yaml", "requirements.txt"}


def export_sha256(folder: Path) -> str:
    """One sha256 over every served file of an export folder: relative paths and contents."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in _NOT_DIGESTED:
            continue
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def mlmodel_for(meta: dict[str, Any], run_id: str | None = None, folder: str = "export") -> Any:
    """The export as an MLflow `Model`: a tensor signature (batch axis -1) and an `hpcml` flavor
    naming the files; no pyfunc flavor, since that would mean loading by unpickling."""
    import numpy as np
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    def spec(side: dict[str, Any], default: str) -> Schema:
        dtype = np.dtype(side.get("dtype", "float32"))
        shape = (-1, *[int(d) for d in side.get("shape", [])])
        return Schema([TensorSpec(dtype, shape, side.get("name", default))])

    model = Model(artifact_path=folder, run_id=run_id)
    model.signature = ModelSignature(
        inputs=spec(meta.get("input") or {}, "input"),
        outputs=spec(meta.get("output") or {}, "logits"),
    )
    model.add_flavor(
        "hpcml",
        format=str(meta.get("format", "")),
        architecture=str(meta.get("architecture", "")),
        weights="model.safetensors",
        meta="model.json",
        serve="hpcml serve models:/NAME@ALIAS",
    )
    return model


def log_mlmodel(client: MlflowClient, run_id: str, meta: dict[str, Any], folder: str) -> None:
    """Write the export's `MLmodel` into the run's artifact folder `folder`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / MLMODEL
        mlmodel_for(meta, run_id, folder).save(str(path))
        client.log_artifact(run_id, str(path), folder)
