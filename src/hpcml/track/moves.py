"""Alias moves in the registry, attributed: who moved it, when and why, as tags of the version
the alias now names (`hpcml.alias.<alias>.moved_by`, `.moved_at`, `.reason`), and as a record
of the audit log when one is kept (`hpcml.track.audit`). Every move hpcml makes (promotion,
the promotion gate, a canary's rollback, `registry register --alias`) goes through here."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from hpcml.track.audit import Attribution

if TYPE_CHECKING:
    from mlflow import MlflowClient

TAG = "hpcml.alias"


def move_alias(
    client: MlflowClient,
    name: str,
    alias: str,
    version: int | str,
    by: Attribution | None = None,
    action: str = "alias.move",
    **details: Any,
) -> dict[str, str]:
    """Point `alias` of model `name` at `version` and record the move; returns the tags.
    `by` None: the OS user of this process, no reason, no audit log."""
    by = by or Attribution.local()
    client.set_registered_model_alias(name, alias, str(version))
    when = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    tags = {
        f"{TAG}.{alias}.moved_by": by.who,
        f"{TAG}.{alias}.moved_at": when,
        f"{TAG}.{alias}.reason": by.why[:4000],
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, value)
    if by.log is not None:
        by.log.append(by.who, action, f"models:/{name}@{alias}", by.why,
                      version=str(version), **details)  # fmt: skip
    return tags
