"""Workers of `-m hpcml` forked from torchrun's agent (hpcml.launch.forked_workers) on a CPU build of
torch. That they train as exec'd workers do is what every multi-process test of the suite checks
(they all run forked now), and test_train_run's external torchrun (stock, exec'd workers) gives
the `--nproc 2` losses bit for bit; here: that the workers really are forked (they do not import
torch again), and that their exit code reaches the agent as before."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch
from tests.conftest import hpcml_env

from hpcml.launch.forked_workers import forked_command, forks_workers

pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="forks on CPU builds only")


def _agent(tmp_path, fork: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """2 workers of `hpcml train MISSING.yaml` (each ends at once with exit 2) under hpcml's
    agent; the CPU seconds of the agent and its workers."""
    env = {**hpcml_env(), "HPCML_FORK_WORKERS": fork}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcml.launch.agent", "--standalone", "--nproc-per-node", "2",
         "-m", "hpcml", "train", "missing.yaml"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, cpu


def test_forked_workers_skip_the_import_and_keep_the_exit_code(tmp_path):
    forked, cpu_forked = _agent(tmp_path, "1")
    execd, cpu_execd = _agent(tmp_path, "0")
    for proc in (forked, execd):
        # The first failed worker's code. (Its sentence is printed by rank 0 unless the agent
        # stopped rank 0 first: a config error here comes before the signal handlers that hold
        # torchrun's SIGTERM off; `hpcml train --nproc` checks the config before any worker.)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Terminating process" not in proc.stderr  # torch's log lines stay silenced
    # Each exec'd worker imports torch and hpcml again (~2 CPU s each here, the agent's own
    # start-up about as much), a forked one only runs the command: forking must save at least
    # a third of the three processes' CPU. A worker silently exec'd again would not.
    assert cpu_forked < cpu_execd * 2 / 3, (cpu_forked, cpu_execd)


def test_only_python_dash_m_hpcml_is_forked(monkeypatch):
    py = sys.executable
    assert forked_command(py, ["-u", "-m", "hpcml", "train", "a.yaml"]) == ["train", "a.yaml"]
    assert forked_command(py, ["-u", "-m", "other", "train"]) is None  # another module
    assert forked_command(py, ["-u", "script.py"]) is None  # a script
    assert forked_command("hpcml", ["train"]) is None  # --no-python: an executable
    monkeypatch.setenv("HPCML_FORK_WORKERS", "0")
    assert not forks_workers()
    monkeypatch.setenv("HPCML_FORK_WORKERS", "1")
    assert forks_workers()
    monkeypatch.delenv("HPCML_FORK_WORKERS")
    assert forks_workers() == (torch.version.cuda is None)
    assert os.environ.get("HPCML_FORK_WORKERS") is None
