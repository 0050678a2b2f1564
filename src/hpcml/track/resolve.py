"""Resolving a registry URI for serving: `models:/NAME@ALIAS`, `models:/NAME/VERSION` or
`models:/NAME/latest` to a local export folder whose files match the sha256 tagged at
registration (`hpcml.track.registry.register_run` writes it)."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpcml.track.mlmodel import export_sha256
from hpcml.track.registry import (
    EXPORT_META,
    SHA256_TAG,
    RegistryError,
    _all_versions,
    _get_version,
    _registered_model,
)
from hpcml.track.store import local_path_of, open_client

_URI_ALIAS_RE = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[A-Za-z0-9_\-]+)$")
_URI_VERSION_RE = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+|latest)$")

def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """`models:/NAME@ALIAS` -> (NAME, ALIAS, None); `models:/NAME/V` -> (NAME, None, V)."""
    m = _URI_ALIAS_RE.match(uri)
    if m:
        return m["name"], m["alias"], None
    m = _URI_VERSION_RE.match(uri)
    if m:
        return m["name"], None, m["version"]
    raise RegistryError(
        f"model URI {uri!r} is not understood; write models:/NAME@ALIAS (e.g. "
        "models:/digits@production) or models:/NAME/VERSION (e.g. models:/digits/3)."
    )


@dataclass(frozen=True)
class ResolvedModel:
    """A registry URI pinned down: which version it meant, and where its export lies."""

    name: str
    version: int
    path: Path
    aliases: tuple[str, ...]
    run_id: str | None


def resolve_model(
    uri: str, tracking_uri: str | None = None, dst_dir: Path | None = None
) -> ResolvedModel:
    """Resolve `models:/NAME@ALIAS`, `models:/NAME/VERSION` or `models:/NAME/latest`.

    Local artifact stores are read in place; remote ones are downloaded into `dst_dir` (a fresh
    temporary folder when None).
    """
    name, alias, version = parse_model_uri(uri)
    client, store = open_client(tracking_uri)
    rm = _registered_model(client, name)
    if alias is not None:
        if alias not in rm.aliases:
            held = ", ".join(sorted(rm.aliases)) or "none"
            raise RegistryError(
                f"model {name!r} has no alias {alias!r} (aliases set: {held}); promote a version "
                f"with `hpcml registry promote {name} --version V --to {alias}`."
            )
        version = str(rm.aliases[alias])
    elif version == "latest":
        versions = _all_versions(client, name)
        if not versions:
            raise RegistryError(f"model {name!r} has no versions; register a run first.")
        version = str(versions[0].version)
    assert version is not None
    mv = _get_version(client, name, version)
    source = client.get_model_version_download_uri(name, version)
    local = local_path_of(source)
    if local is None or not local.exists():
        from mlflow.artifacts import download_artifacts

        target = dst_dir or Path(tempfile.mkdtemp(prefix=f"hpcml-{name}-v{version}-"))
        local = Path(
            download_artifacts(artifact_uri=source, dst_path=str(target), tracking_uri=store)
        )
    if not (local / EXPORT_META).is_file():
        raise RegistryError(
            f"{uri} (version {version}) points at {source}, which holds no {EXPORT_META}; "
            "the artifacts were moved or deleted, register the run again."
        )
    check_sha256(uri, version, local, (mv.tags or {}).get(SHA256_TAG))
    aliases = tuple(sorted(a for a, v in rm.aliases.items() if str(v) == str(version)))
    return ResolvedModel(name, int(version), local, aliases, mv.run_id)


def check_sha256(uri: str, version: str, local: Path, expected: str | None) -> None:
    """Refuse an artifact that is not byte for byte what was registered."""
    if expected is None:
        raise RegistryError(
            f"{uri} (version {version}) has no {SHA256_TAG} tag, so its files cannot be checked "
            "against what was registered; register the run again with `hpcml registry register`."
        )
    actual = export_sha256(local)
    if actual != expected:
        raise RegistryError(
            f"{uri} (version {version}): the files in {local} have sha256 {actual[:12]}..., not "
            f"the {expected[:12]}... registered; the artifact was changed after registration, "
            "so it is not served (register a trusted run again)."
        )


def alias_version(uri: str, tracking_uri: str | None = None) -> str:
    """The version a URI names now, without resolving its files (cheap enough to poll)."""
    name, alias, version = parse_model_uri(uri)
    client, _ = open_client(tracking_uri)
    rm = _registered_model(client, name)
    if alias is not None:
        if alias not in rm.aliases:
            raise RegistryError(f"model {name!r} has no alias {alias!r} any more.")
        return str(rm.aliases[alias])
    if version == "latest":
        versions = _all_versions(client, name)
        if not versions:
            raise RegistryError(f"model {name!r} has no versions; register a run first.")
        return str(versions[0].version)
    assert version is not None
    return version


def resolve_model_uri(
    uri: str, tracking_uri: str | None = None, dst_dir: Path | None = None
) -> Path:
    """The local export folder (holding model.json) a registry URI points at; for serving."""
    return resolve_model(uri, tracking_uri=tracking_uri, dst_dir=dst_dir).path
