"""Where served models come from: one export folder, or a repository of `NAME/VERSION/` exports.

`resolve_model_source` is the single place that turns the PATH given to `hpcml serve` into
model names, versions and export folders, so that other sources (a registry URI such as
`models:/NAME@alias`) can be added here without touching the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpcml.errors import ModelError
from hpcml.models.export import META, read_export_meta


@dataclass
class ModelSource:
    kind: Literal["export", "repository"]
    path: Path
    models: dict[str, dict[str, Path]] = field(default_factory=dict)
    """name -> version -> export folder."""


def _export_dir(path: Path) -> Path | None:
    if (path / META).exists():
        return path
    if (path / "export" / META).exists():
        return path / "export"
    return None


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (1 << 62, version)


def sorted_versions(versions: list[str] | dict[str, object]) -> list[str]:
    """Versions oldest first; numeric versions compare as numbers (2 < 10)."""
    return sorted(versions, key=_version_key)


def resolve_model_source(path: str | Path, name: str | None = None) -> ModelSource:
    """An export (or run) folder served as NAME version 1, or a model repository folder.

    A repository holds `NAME/VERSION/` folders, each an export folder (`model.json` +
    `model.safetensors`) or a run folder with `export/`; VERSION is a positive integer.
    """
    if str(path).startswith("models:"):
        # A registered model (MLflow registry): `models:/NAME@ALIAS`, `models:/NAME/VERSION`.
        from hpcml.track.resolve import resolve_model

        resolved = resolve_model(str(path))
        served_name = name or resolved.name
        return ModelSource(
            "export", resolved.path, {served_name: {str(resolved.version): resolved.path}}
        )
    root = Path(path).expanduser()
    if not root.is_dir():
        state = "is a file, not a folder" if root.exists() else "does not exist"
        raise ModelError(
            f"model path {root} {state}; pass an export folder, a run folder or a "
            "model repository (NAME/VERSION/ folders)."
        )
    export = _export_dir(root)
    if export is not None:
        served_name = name or str(read_export_meta(export).get("architecture", "model"))
        return ModelSource("export", root, {served_name: {"1": export}})
    models: dict[str, dict[str, Path]] = {}
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        versions = {}
        for version_dir in model_dir.iterdir():
            if version_dir.is_dir() and version_dir.name.isdigit() and int(version_dir.name) > 0:
                found = _export_dir(version_dir)
                if found is not None:
                    versions[version_dir.name] = found
        if versions:
            models[model_dir.name] = versions
    if not models:
        raise ModelError(
            f"{root} is neither an export ({META} missing) nor a model repository (no "
            f"NAME/VERSION/{META} inside); point at a run's export/ folder or a repository."
        )
    if name is not None:
        if name not in models:
            raise ModelError(
                f"model repository {root} has no model '{name}'; it holds {', '.join(models)}."
            )
        models = {name: models[name]}
    return ModelSource("repository", root, models)
