"""The model registry on MLflow: versions made from run folders, aliases, a promotion gate.

A model version's source is the `export/` folder (model.safetensors + model.json) logged as an
artifact of the MLflow run that trained it; its tags carry the run's final metrics and
provenance, so `promote_if_better` and a human in the UI read the same numbers.
`hpcml.track.resolve` turns `models:/NAME@ALIAS` or `models:/NAME/VERSION` into a local export
folder for serving.

Integrity: `register_run` tags the version with `hpcml.artifact_sha256`, a digest of the export's
files, and `resolve_model` refuses an artifact whose files no longer match it (changed in the
store after registration; see `hpcml.track.resolve`). The export is also described as an MLflow Model (`MLmodel` with a
tensor signature and an `hpcml` flavor) so the MLflow UI shows its inputs and outputs; nothing
reads that file back, and loading never unpickles (safetensors + model.json).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hpcml.config import TrackingConfig
from hpcml.errors import HpcmlError
from hpcml.models.signing import SIGNATURE
from hpcml.records import RUN_LOG, SUMMARY, read_run_log, read_summary
from hpcml.track.audit import Attribution
from hpcml.track.mlflow import (
    EXPORT_DIR,
    MlflowTracker,
    numeric_items,
    read_tracking_state,
)
from hpcml.track.mlmodel import export_sha256, log_mlmodel
from hpcml.track.moves import move_alias
from hpcml.track.provenance import to_tags
from hpcml.track.store import open_client

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

ALIASES = ("staging", "production")
EXPORT_META = "model.json"
SHA256_TAG = "hpcml.artifact_sha256"
CANARY_TAG = "hpcml.canary"
# Exit code of `hpcml registry promote --if-better` when the candidate is not promoted.
EXIT_NOT_PROMOTED = 3

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\- ]*$")


class RegistryError(HpcmlError):
    """A registry request that cannot be met: unknown model, version or alias, unusable run."""


@dataclass
class Decision:
    """The outcome of the promotion gate, with the numbers it compared."""

    promoted: bool
    name: str
    alias: str
    metric: str
    mode: Literal["max", "min"]
    candidate_version: int
    candidate_value: float
    incumbent_version: int | None
    incumbent_value: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise RegistryError(
            f"model name {name!r} is not allowed; use letters, digits, '_', '-', '.' or spaces, "
            "starting with a letter or digit."
        )
    return name


def check_alias(alias: str) -> str:
    if alias not in ALIASES:
        raise RegistryError(f"alias {alias!r} is not known; use one of {', '.join(ALIASES)}.")
    return alias


def metric_mode(metric: str) -> Literal["max", "min"]:
    """Losses, errors and perplexities improve downwards; everything else (accuracy, F1) upwards."""
    lowered = metric.lower()
    return (
        "min" if any(w in lowered for w in ("loss", "error", "perplexity", "mse", "mae")) else "max"
    )


# -- registering ---------------------------------------------------------------------------


def register_run(
    run_dir: Path,
    name: str,
    tracking_uri: str | None = None,
    alias: str | None = None,
    description: str | None = None,
    by: Attribution | None = None,
) -> dict[str, Any]:
    """Create a version of model `name` from RUN_DIR/export, linked to the run's MLflow run;
    with `alias`, point it there too (attributed to `by`, see `hpcml.track.moves`).

    A run folder trained with tracking on this store is linked to its MLflow run; one trained
    without tracking (or tracked elsewhere) is first logged as a new MLflow run here, with its
    config, step metrics, summary and export, so every version has a run behind it.
    """
    run_dir = Path(run_dir)
    check_name(name)
    if alias is not None:
        check_alias(alias)
    export = run_dir / EXPORT_DIR
    if not (export / EXPORT_META).is_file():
        raise RegistryError(
            f"run folder {run_dir} has no {EXPORT_DIR}/{EXPORT_META}; register a folder written "
            "by a finished `hpcml train` run."
        )
    if not (run_dir / SUMMARY).is_file():
        raise RegistryError(
            f"run folder {run_dir} has no {SUMMARY}; register a folder written by a finished "
            "`hpcml train` run."
        )
    summary = read_summary(run_dir)
    status = summary.get("status", "finished")
    if status != "finished":
        raise RegistryError(
            f"run folder {run_dir} ended with status {status!r}; only finished runs can be "
            "registered, resume it to the end first (`hpcml train ... --resume auto`)."
        )
    client, uri = open_client(tracking_uri)
    run_id, artifact_uri = _linked_run(client, uri, run_dir, summary)
    meta = _read_json(export / EXPORT_META)
    arch = meta.get("architecture")
    tags = _version_tags(summary, run_dir, arch)
    tags[SHA256_TAG] = export_sha256(export)
    folder = _artifact_folder(client, run_id, export, tags[SHA256_TAG])
    log_mlmodel(client, run_id, meta, folder)
    _ensure_registered_model(client, name)
    version = client.create_model_version(
        name,
        source=f"{artifact_uri}/{folder}",
        run_id=run_id,
        tags=tags,
        description=description or f"{arch or 'model'} trained in {run_dir.resolve()}",
    )
    if alias is not None:
        move_alias(client, name, alias, version.version, by, "registry.register")
    return version_info(client, name, int(version.version), tracking_uri=uri)


def _linked_run(
    client: MlflowClient, uri: str, run_dir: Path, summary: dict[str, Any]
) -> tuple[str, str]:
    """(run_id, artifact_uri) of the MLflow run holding this folder's export; made if needed."""
    from mlflow.exceptions import MlflowException

    state = read_tracking_state(run_dir)
    if state is not None and state.get("tracking_uri") == uri:
        try:
            run = client.get_run(state["run_id"])
        except MlflowException:
            run = None
        if run is not None and run.info.lifecycle_stage == "active":
            if not client.list_artifacts(run.info.run_id, EXPORT_DIR):
                client.log_artifacts(run.info.run_id, str(run_dir / EXPORT_DIR), EXPORT_DIR)
            return run.info.run_id, run.info.artifact_uri
    # Remember the new run in tracking.json unless that file names a run in another store.
    remember = state is None or state.get("tracking_uri") == uri
    return _log_untracked_run(run_dir, summary, uri, remember=remember)


def _artifact_folder(client: MlflowClient, run_id: str, export: Path, sha256: str) -> str:
    """The run's artifact folder a new version points at: `export`, unless the export was
    signed (`hpcml export sign`) after the run logged it; then the signed export is logged
    to a folder of its own, leaving the one earlier versions point at (and their sha256) as
    it was."""
    logged = {Path(f.path).name for f in client.list_artifacts(run_id, EXPORT_DIR)}
    if not (export / SIGNATURE).is_file() or SIGNATURE in logged:
        return EXPORT_DIR
    folder = f"{EXPORT_DIR}-signed-{sha256[:12]}"
    client.log_artifacts(run_id, str(export), folder)
    return folder


def _log_untracked_run(
    run_dir: Path, summary: dict[str, Any], uri: str, remember: bool
) -> tuple[str, str]:
    config = summary.get("config") or {}
    tracking = config.get("tracking") or {}
    cfg = TrackingConfig.model_validate(
        {
            "backend": "mlflow",
            "uri": uri,
            "experiment": tracking.get("experiment") or "hpcml",
            "run_name": tracking.get("run_name"),
            "tags": tracking.get("tags") or {},
            "log_every": tracking.get("log_every") or 10,
        }
    )
    tracker = MlflowTracker(cfg, run_dir, remember=remember)
    tags = to_tags(summary.get("provenance") or {})
    tags["hpcml.logged_by"] = "registry register"
    tracker.start(_flatten(config), tags)
    records = read_run_log(run_dir / RUN_LOG)
    tracker.log_steps([r for r in records if r.get("kind", "step") == "step"])
    for record in records:
        if record.get("kind") == "eval":
            tracker.log_eval(record)
    tracker.finish(summary, "finished", run_dir)
    assert tracker.run_id is not None and tracker.artifact_uri is not None
    return tracker.run_id, tracker.artifact_uri


def _version_tags(summary: dict[str, Any], run_dir: Path, arch: str | None) -> dict[str, str]:
    tags = {k: repr(v) for k, v in numeric_items(summary.get("final") or {}).items()}
    tags["run_dir"] = str(run_dir.resolve())
    if arch:
        tags["architecture"] = arch
    for key in ("steps", "world_size", "precision"):
        if summary.get(key) is not None:
            tags[key] = str(summary[key])
    data = summary.get("data") or {}
    if data.get("version"):
        tags["data_version"] = str(data["version"])
    read = [str(r.get("version")) for r in data.get("versions_read") or [] if isinstance(r, dict)]
    if len(read) > 1:  # a resume with --allow-data-change: every version, in order
        tags["data_versions_read"] = ",".join(read)
    prov = to_tags(summary.get("provenance") or {})
    for src, dst in (
        ("hpcml.config_hash", "config_hash"),
        ("hpcml.data_fingerprint", "data_fingerprint"),
        ("mlflow.source.git.commit", "git_commit"),
        ("hpcml.git_dirty", "git_dirty"),
    ):
        if src in prov:
            tags[dst] = prov[src]
    return tags


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise


# -- reading -------------------------------------------------------------------------------


def _get_version(client: MlflowClient, name: str, version: int | str) -> ModelVersion:
    from mlflow.exceptions import MlflowException

    check_name(name)
    _registered_model(client, name)
    try:
        return client.get_model_version(name, str(version))
    except MlflowException:
        raise RegistryError(
            f"model {name!r} has no version {version}; see `hpcml registry list {name}`."
        ) from None


def _registered_model(client: MlflowClient, name: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException:
        raise RegistryError(
            f"no registered model named {name!r} in this store; create one with "
            f"`hpcml registry register RUN_DIR --name {name}` (or pass --tracking-uri)."
        ) from None


def _all_versions(client: MlflowClient, name: str) -> list[ModelVersion]:
    versions = list(client.search_model_versions(f"name = '{name}'"))
    return sorted(versions, key=lambda v: int(v.version), reverse=True)


def version_info(
    client: MlflowClient, name: str, version: int, tracking_uri: str | None = None
) -> dict[str, Any]:
    rm = _registered_model(client, name)
    mv = _get_version(client, name, version)
    return _describe(mv, rm.aliases, tracking_uri)


def _describe(mv: ModelVersion, aliases: dict[str, Any], uri: str | None) -> dict[str, Any]:
    tags = dict(mv.tags or {})
    metrics = {}
    for key, value in tags.items():
        try:
            metrics[key] = float(value)
        except ValueError:
            continue
    return {
        "name": mv.name,
        "version": int(mv.version),
        "aliases": sorted(a for a, v in aliases.items() if str(v) == str(mv.version)),
        "uri": f"models:/{mv.name}/{mv.version}",
        "run_id": mv.run_id,
        "source": mv.source,
        "status": mv.status,
        "created": datetime.fromtimestamp(mv.creation_timestamp / 1000, UTC).isoformat(
            timespec="seconds"
        ),
        "metrics": {k: v for k, v in metrics.items() if k not in ("steps", "world_size")},
        "tags": tags,
        "tracking_uri": uri,
    }


def list_versions(name: str, tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """Every version of `name`, newest first, with its aliases and metric tags."""
    check_name(name)
    client, uri = open_client(tracking_uri)
    rm = _registered_model(client, name)
    return [_describe(mv, rm.aliases, uri) for mv in _all_versions(client, name)]


# -- aliases and the gate ------------------------------------------------------------------


def promote(
    name: str,
    version: int,
    alias: str = "production",
    tracking_uri: str | None = None,
    by: Attribution | None = None,
) -> dict[str, Any]:
    """Point `alias` at `version` (moving it away from whichever version held it); the move
    is attributed to `by` (default: this OS user)."""
    check_alias(alias)
    client, uri = open_client(tracking_uri)
    _get_version(client, name, version)
    previous = _registered_model(client, name).aliases.get(alias)
    move_alias(client, name, alias, version, by, "registry.promote",
               previous=None if previous is None else str(previous))  # fmt: skip
    return version_info(client, name, version, tracking_uri=uri)


def version_metric(client: MlflowClient, mv: ModelVersion, metric: str) -> float | None:
    """The version's tag `metric`, else its run's final value of it (`final/metric`, `metric`)."""
    from mlflow.exceptions import MlflowException

    raw = (mv.tags or {}).get(metric)
    if raw is not None:
        try:
            return float(raw)
        except ValueError:
            pass
    if mv.run_id:
        try:
            metrics = client.get_run(mv.run_id).data.metrics
        except MlflowException:
            return None
        for key in (f"final/{metric}", metric):
            if key in metrics:
                return float(metrics[key])
    return None


def promote_if_better(
    name: str,
    metric: str,
    version: int | None = None,
    alias: str = "production",
    mode: Literal["max", "min"] | None = None,
    min_delta: float = 0.0,
    tracking_uri: str | None = None,
    by: Attribution | None = None,
) -> Decision:
    """Move `alias` to the candidate (`version`, default the newest) only when its `metric`
    beats the current holder's by more than `min_delta`; a model with no holder is promoted.
    A move is attributed to `by` (default: this OS user), with the gate's reason after it."""
    check_alias(alias)
    client, _ = open_client(tracking_uri)
    rm = _registered_model(client, name)
    if version is None:
        versions = _all_versions(client, name)
        if not versions:
            raise RegistryError(f"model {name!r} has no versions; register a run first.")
        candidate = versions[0]
    else:
        candidate = _get_version(client, name, version)
    mode = mode or metric_mode(metric)
    cand_value = version_metric(client, candidate, metric)
    if cand_value is None:
        raise RegistryError(
            f"version {candidate.version} of {name!r} has no metric {metric!r} (neither a tag nor "
            "in its run); pick a metric the run recorded, e.g. val_accuracy or val_loss."
        )
    cand_version = int(candidate.version)
    holder = rm.aliases.get(alias)

    def decide(promoted: bool, inc: int | None, inc_value: float | None, why: str) -> Decision:
        if promoted:
            base = by or Attribution.local()
            gate = f"gate: {why}"
            attributed = replace(base, why=f"{base.why}; {gate}" if base.why else gate)
            move_alias(client, name, alias, cand_version, attributed, "registry.promote",
                       previous=None if inc is None else str(inc))  # fmt: skip
        return Decision(
            promoted, name, alias, metric, mode, cand_version, cand_value, inc, inc_value, why
        )

    if holder is None:
        return decide(True, None, None, f"no version held {alias!r}")
    inc_version = int(holder)
    if inc_version == cand_version:
        return decide(
            False, inc_version, cand_value, f"version {cand_version} already holds {alias!r}"
        )
    inc_value = version_metric(client, _get_version(client, name, inc_version), metric)
    if inc_value is None:
        raise RegistryError(
            f"the {alias} version {inc_version} of {name!r} has no metric {metric!r}, so the "
            f"gate cannot compare; promote explicitly with --version {cand_version} --to {alias}."
        )
    gain = cand_value - inc_value if mode == "max" else inc_value - cand_value
    better = gain > min_delta
    op = ">" if mode == "max" else "<"
    if better:
        why = f"{metric} {cand_value:.6g} {op} {inc_value:.6g} (version {inc_version})"
    else:
        why = (
            f"{metric} {cand_value:.6g} is not better than {inc_value:.6g} of version "
            f"{inc_version} by more than {min_delta:g} ({mode} is better)"
        )
    return decide(better, inc_version, inc_value, why)


# -- canary outcomes (written by a server that follows an alias) ---------------------------


def record_canary(
    name: str,
    version: int | str,
    decision: Literal["completed", "rolled_back", "abandoned"],
    reason: str,
    evidence: dict[str, Any],
    tracking_uri: str | None = None,
) -> dict[str, str]:
    """Tag `version` with its canary's outcome (`hpcml.canary.decision`, `.reason`, and each
    number of `evidence`), so the registry says why it is or is not serving. The decision is
    written last: a reader that sees it sees the rest."""
    client, _ = open_client(tracking_uri)
    tags = {f"{CANARY_TAG}.{k}": str(v) for k, v in evidence.items() if v is not None}
    tags[f"{CANARY_TAG}.reason"] = reason[:4000]
    tags[f"{CANARY_TAG}.decision"] = decision
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, value)
    return tags


def roll_back_alias(
    name: str,
    alias: str,
    candidate: int | str,
    previous: int | str,
    tracking_uri: str | None = None,
    by: Attribution | None = None,
) -> bool:
    """Point `alias` back at `previous` if it still names `candidate`; True when it moved it.

    If someone moved the alias since (a newer promotion, a person), that choice stands. The read
    and the write are two requests (MLflow has no compare-and-set): a promotion landing between
    them is overwritten, and shows in the candidate's tags."""
    client, _ = open_client(tracking_uri)
    if str(_registered_model(client, name).aliases.get(alias)) != str(candidate):
        return False
    move_alias(client, name, alias, previous, by, "canary.rollback", candidate=str(candidate))
    return True


# -- helpers -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise RegistryError(f"{path} is not readable JSON; re-export the model.") from None
    return data if isinstance(data, dict) else {}


def _flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(_flatten(value, dotted))
        else:
            out[dotted] = value
    return out
