"""Shared test helpers: run the real `hpcml` command in a subprocess and read run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def in_ci() -> bool:
    """CI=true (what `.ci/run` sets; 1 and yes too): a test whose system tool is missing fails."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def system_binary(*names: str, installer: str) -> str:
    """The path of a program a Debian package provides (the first of `names` found). Missing:
    the test fails under CI=true (`.ci/run` runs every `.ci/install_*.sh` first), else it skips
    saying how to install it. tests/unit/test_ci_installers.py checks that `installer` exists
    and names the program."""
    import shutil

    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    if in_ci():
        pytest.fail(f"{names[0]} is missing in CI; {installer} should install it.", pytrace=False)
    pytest.skip(f"{names[0]} is not installed (bash {installer} installs it)")


def hpcml_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def run_hpcml(*args: str, cwd: Path | None = None, timeout: float = 300, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpcml", *args],
        cwd=cwd or ROOT,
        env=env or hpcml_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"hpcml {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def step_losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run_dir / "run.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            out[int(rec["step"])] = rec["loss"]
    return out


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session", autouse=True)
def _hpcml_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shard hash cache (`hpcml.data.shards.hash_cache`, else ~/.cache/hpcml) goes to this
    session's temporary folder, for this process and the `hpcml` processes tests start: a test
    writes nothing outside its temporary folders."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPCML_CACHE_DIR", str(tmp_path_factory.mktemp("hpcml-cache")))
        yield


@pytest.fixture
def tiny_args() -> list[str]:
    """Overrides that make a digits run take a few seconds."""
    return [
        "data.batch_size=16",
        "train.eval_every=0",
        "train.log_every=2",
        "train.deterministic=true",
    ]
