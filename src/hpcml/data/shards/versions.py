"""Which shard set versions a run read, across its resumes.

A checkpoint stores the versions (`hpcml.data.shards.version_id`, the sha256 of a shard set's
manifest) its run has read so far, in order. A resume onto a shard set of another version is
refused in one sentence unless `data.allow_change` (`hpcml train --allow-data-change`), which
appends the new version: the run's summary, its export (`model.json`), its registry entry and
its MLflow dataset inputs then name every version read, not only the last.
"""

from __future__ import annotations

from pathlib import Path

from hpcml.errors import DataError


def _describe(version: str | None) -> str:
    return "data without a shard set version" if version is None else f"shard set {version[:16]}"


Read = dict[str, str | None]
"""One shard set read: {"version": its version id (None for data without one), "path": where}."""


def first_read(version: str | None, path: str | None) -> list[Read]:
    """The record of a run that starts from step 0."""
    return [] if version is None else [{"version": version, "path": path}]


def versions_after_resume(
    saved: list[Read] | None,
    current: str | None,
    *,
    allow_change: bool,
    checkpoint: Path,
    source: str,
    path: str | None,
) -> list[Read]:
    """The versions read once this run resumes from `checkpoint` (which had read `saved`;
    None when written before versions were stored) on data of version `current` at `path`."""
    if saved is None:  # nothing to compare with: the record starts here
        return first_read(current, path)
    last = saved[-1]["version"] if saved else None
    if last == current:
        return list(saved)
    if not allow_change:
        where = f"data.path {path}" if path else f"data.source {source!r}"
        raise DataError(
            f"checkpoint {checkpoint} was trained on {_describe(last)}, but {where} holds "
            f"{_describe(current)}; resume on the data it was trained on, or pass "
            "--allow-data-change to continue on this data (every version read is then recorded)."
        )
    return [*saved, {"version": current, "path": path}]
