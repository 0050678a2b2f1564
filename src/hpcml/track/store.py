"""Where MLflow data lives: the tracking URI rule, the client, experiments and artifact folders.

One rule for every caller (training, `hpcml registry`, serving): an explicit URI, else
`$MLFLOW_TRACKING_URI`, else a SQLite store `mlruns.db` in the working folder. The model registry
always lives in the same store. A SQLite store keeps its artifacts next to the database in
`mlartifacts/`, so the store is one folder a user can copy or delete.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from hpcml.errors import HpcmlError

if TYPE_CHECKING:
    from mlflow import MlflowClient

DEFAULT_DB = "mlruns.db"
ARTIFACTS_DIR = "mlartifacts"


class TrackingError(HpcmlError):
    """A tracking store that cannot be opened or used (bad URI, unreadable database)."""


def default_tracking_uri(cwd: Path | None = None) -> str:
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / DEFAULT_DB}"


def resolve_tracking_uri(uri: str | None) -> str:
    """Explicit URI > $MLFLOW_TRACKING_URI > sqlite:///<cwd>/mlruns.db; relative SQLite paths made absolute.

    Absolute paths matter: a run folder records its URI in tracking.json, and a resume or a
    `registry register` from another working folder must reach the same database.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    db = sqlite_path(uri)
    if db is not None and not db.is_absolute():
        uri = f"sqlite:///{db.resolve()}"
    elif "://" not in uri:
        # A bare folder is MLflow's file store; spell it as a URI so it is unambiguous.
        uri = Path(uri).resolve().as_uri()
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI (None for other stores and in-memory SQLite)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :]
    if not path or path == ":memory:":
        return None
    return Path(path)


def artifact_location_for(uri: str, experiment: str) -> str | None:
    """Artifacts of a SQLite store sit beside the database; other stores choose their own."""
    db = sqlite_path(uri)
    if db is None:
        return None
    return (db.parent / ARTIFACTS_DIR / _safe_name(experiment)).as_uri()


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "experiment"


def local_path_of(artifact_uri: str) -> Path | None:
    """A `file://` URI or a plain path as a local Path; None for remote artifact stores."""
    parsed = urlparse(artifact_uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and artifact_uri:
        return Path(artifact_uri)
    return None


def open_client(uri: str | None) -> tuple[MlflowClient, str]:
    """An MlflowClient on the resolved URI (tracking and registry), and that URI.

    The first use of a new SQLite database runs MLflow's schema migrations (a few seconds).
    """
    uri = resolve_tracking_uri(uri)
    db = sqlite_path(uri)
    if db is not None and not db.parent.exists():
        raise TrackingError(
            f"tracking store {uri} is in folder {db.parent}, which does not exist; "
            "create the folder or set tracking.uri to another sqlite:///ABS/PATH.db."
        )
    # MLflow announces each schema migration at INFO; a CLI user needs none of it.
    for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
    except ImportError:
        raise TrackingError(
            "tracking with MLflow needs the mlflow package, which is not installed; install it "
            "with pip install 'hpcml[track]' or set tracking.backend=none."
        ) from None

    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        # Touch the store now so a bad URI fails here, with a clear sentence, not mid-training.
        client.search_experiments(max_results=1)
    except (MlflowException, OSError, ValueError) as exc:
        raise TrackingError(
            f"tracking store {uri} cannot be opened ({_first_line(exc)}); check tracking.uri "
            "(e.g. sqlite:///ABS/PATH/mlruns.db or http://HOST:5000)."
        ) from None
    except Exception as exc:  # noqa: BLE001 - sqlalchemy and drivers raise their own types
        raise TrackingError(
            f"tracking store {uri} cannot be opened ({type(exc).__name__}: {_first_line(exc)}); "
            "check tracking.uri."
        ) from None
    return client, uri


def get_or_create_experiment(client: MlflowClient, uri: str, name: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            # A deleted experiment's name stays taken; bring it back rather than fail.
            client.restore_experiment(exp.experiment_id)
        return str(exp.experiment_id)
    try:
        return str(
            client.create_experiment(name, artifact_location=artifact_location_for(uri, name))
        )
    except MlflowException:
        # Another process created it between our lookup and create.
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def stringify(value: Any, limit: int) -> str:
    """Param/tag values as MLflow stores them, cut to its length limit instead of rejected."""
    import json

    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
