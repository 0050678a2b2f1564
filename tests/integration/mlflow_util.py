"""A migrated MLflow SQLite store per test module, shared by the tracking tests."""

from __future__ import annotations

import shutil

import pytest

from hpcml.track.store import open_client


def fresh_store(factory: pytest.TempPathFactory, name: str) -> str:
    """A migrated SQLite store of its own: MLflow's schema migrations (seconds) run once per
    session into a template that each test module copies."""
    template = factory.getbasetemp() / "mlflow-template" / "mlruns.db"
    if not template.exists():
        template.parent.mkdir(exist_ok=True)
        open_client(f"sqlite:///{template}")
    db = factory.mktemp(name) / "mlruns.db"
    shutil.copyfile(template, db)
    return open_client(f"sqlite:///{db}")[1]
