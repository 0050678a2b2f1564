"""Provenance: config hash, git state, package versions, data fingerprint, MLflow tags."""

from __future__ import annotations

import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from hpcml.config import load_config
from hpcml.track.provenance import (
    collect,
    config_hash,
    fingerprint_files,
    git_state,
    package_versions,
    to_tags,
)

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "proj"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "train.yaml").write_text("optim:\n  lr: 0.01\n")
    _git(repo, "add", "train.yaml")
    _git(repo, "commit", "-qm", "first")
    return repo


def test_config_hash_is_canonical_and_ignores_tracking() -> None:
    a = load_config(None, ["optim.lr=0.01"]).model_dump(mode="json")
    b = load_config(None, ["optim.lr=0.01", "tracking.backend=mlflow", "tracking.tags.team=x"])
    c = load_config(None, ["optim.lr=0.02"]).model_dump(mode="json")
    reordered = dict(reversed(list(a.items())))
    assert config_hash(a) == config_hash(reordered)
    assert config_hash(a) == config_hash(b.model_dump(mode="json"))
    assert config_hash(a) != config_hash(c)
    assert len(config_hash(a)) == 64


@needs_git
def test_git_state_reports_commit_and_dirty_flag(repo: Path) -> None:
    state = git_state(repo)
    assert state is not None
    assert state["commit"] == _git(repo, "rev-parse", "HEAD")
    assert state["dirty"] is False
    (repo / "untracked.txt").write_text("new run output")
    assert git_state(repo)["dirty"] is False  # type: ignore[index]
    (repo / "train.yaml").write_text("optim:\n  lr: 0.5\n")
    assert git_state(repo)["dirty"] is True  # type: ignore[index]


def test_git_state_outside_a_repository_is_none(tmp_path: Path) -> None:
    assert git_state(tmp_path) is None


def test_package_versions_match_installed_metadata() -> None:
    versions = package_versions()
    assert versions["torch"] == metadata.version("torch")
    assert versions["mlflow"] == metadata.version("mlflow")
    assert versions["hpcml"]
    assert versions["python"].count(".") == 2


@needs_git
def test_collect_and_tags_trace_the_run(repo: Path) -> None:
    cfg = load_config(None).model_dump(mode="json")
    device = {"type": "cpu", "name": "test-cpu", "count": 1}
    prov = collect(cfg, "sha256:abc", device, workdir=repo)
    assert prov["config_hash"] == config_hash(cfg)
    assert prov["data_fingerprint"] == "sha256:abc"
    assert prov["code"]["git"]["commit"] == _git(repo, "rev-parse", "HEAD")
    assert prov["hardware"]["device"] == device
    assert prov["hardware"]["cpu_count"] >= 1
    tags = to_tags(prov)
    assert tags["mlflow.source.git.commit"] == prov["code"]["git"]["commit"]
    assert tags["hpcml.git_dirty"] == "false"
    assert tags["hpcml.config_hash"] == prov["config_hash"]
    assert tags["hpcml.data_fingerprint"] == "sha256:abc"
    assert tags["hpcml.device.name"] == "test-cpu"
    assert tags["hpcml.version.torch"] == metadata.version("torch")
    assert all(isinstance(v, str) for v in tags.values())


def test_collect_without_git_has_no_commit_tag(tmp_path: Path) -> None:
    prov = collect(
        {"model": {}}, "none", {"type": "cpu", "name": "x", "count": 1}, workdir=tmp_path
    )
    assert prov["code"]["git"] is None
    assert "mlflow.source.git.commit" not in to_tags(prov)


def test_fingerprint_files_follows_content_not_location(tmp_path: Path) -> None:
    for name in ("a", "b"):
        d = tmp_path / name / "shards"
        d.mkdir(parents=True)
        (d / "0.bin").write_bytes(b"\x00\x01" * 1000)
        (d / "1.bin").write_bytes(b"\x02" * 10)
    fa = fingerprint_files([tmp_path / "a" / "shards"])
    assert fa.startswith("sha256:")
    assert fa == fingerprint_files([tmp_path / "b" / "shards"])
    (tmp_path / "b" / "shards" / "1.bin").write_bytes(b"\x03" * 10)
    assert fa != fingerprint_files([tmp_path / "b" / "shards"])
    (tmp_path / "a" / "shards" / "1.bin").rename(tmp_path / "a" / "shards" / "2.bin")
    assert fa != fingerprint_files([tmp_path / "a" / "shards"])
