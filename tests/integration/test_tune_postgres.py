"""`hpcml tune --storage postgresql+psycopg://...` against a real PostgreSQL server (Debian's,
from .ci/install_postgres.sh) started here from a temp dir on loopback: two tune workers share
the study through it, and a server that cannot be reached is refused in one sentence. Without
the server the test skips naming the installer; under CI=true it fails."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from tests.conftest import in_ci, system_binary
from tests.integration.test_tune import _cli, run_tune, tune_config

pytestmark = pytest.mark.slow

INSTALLER = ".ci/install_postgres.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A server of our own (trust auth, loopback only) run as the `postgres` user, which
    Debian's package makes: PostgreSQL refuses to run as root. Its folder is not under
    pytest's temp root, which only root may enter."""
    initdb = system_binary("initdb", installer=INSTALLER)
    pg_ctl = system_binary("pg_ctl", installer=INSTALLER)
    runuser = shutil.which("runuser")
    if os.geteuid() != 0 or runuser is None:
        reason = "the PostgreSQL test starts its server as the postgres user, which needs root"
        pytest.fail(reason, pytrace=False) if in_ci() else pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="hpcml-postgres-"))
    root.chmod(0o755)
    data, port = root / "data", _free_port()
    data.mkdir()
    shutil.chown(data, "postgres", "postgres")
    as_pg = [runuser, "-u", "postgres", "--"]
    subprocess.run([*as_pg, initdb, "-D", str(data), "--auth=trust", "-U", "postgres"],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1"
    subprocess.run([*as_pg, pg_ctl, "-D", str(data), "-o", options, "-l", str(data / "log"),
                    "-w", "-t", "120", "start"], check=True, capture_output=True, timeout=150)  # fmt: skip
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_pg, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_share_a_study_on_postgresql(tmp_path: Path, postgres: str):
    config = tune_config(
        tmp_path / "tune.yaml", {"pruner": "none", "trials": 2, "seed": 3}, max_steps=10
    )
    out = tmp_path / "study"
    result = run_tune(config, out, "--workers", "2", "--storage", postgres, "--study", "pg")
    assert result["storage"] == postgres
    assert result["trials"] == {"complete": 2, "pruned": 0, "failed": 0, "infeasible": 0}
    assert not list(out.glob("study.*"))  # nothing of the study in the folder
    trials = optuna.load_study(study_name="pg", storage=postgres).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    for t in trials:  # each value is its run's own final val_loss, written by another process
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert t.value == summary["final"]["val_loss"]


def test_a_postgresql_server_that_cannot_be_reached_exits_2(tmp_path: Path):
    url = f"postgresql+psycopg://postgres@127.0.0.1:{_free_port()}/postgres"  # nobody listens
    config = tune_config(tmp_path / "tune.yaml", {})
    res = _cli(str(config), "--out", str(tmp_path / "study"), "--storage", url)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("error: ") and "cannot be opened" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "study" / "trials").exists()
