"""Workers of `-m hpcml` forked from torchrun's agent (hpcml.launch.forked_workers) on a CPU build of
torch. That they train as exec'd workers do is what every multi-process test of the suite checks
(they all run forked now), and test_train_run's external torchrun (stock, exec'd workers) gives
the `--nproc 2` losses bit for bit; here: that the workers really are forked (they do not import
torch again) and give the losses of exec'd workers bit for bit (a worker's exit codes, signals
and sentences: test_train_worker_errors, test_fault_*)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, hpcml_env, step_losses

from hpcml.launch.forked_workers import forked_command, forks_workers

pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="forks on CPU builds only")


ARGS = ("model.name=mlp", "model.args={hidden: 64}", "train.max_steps=3", "train.eval_every=0",
        "train.checkpoint_every=0", "train.log_every=1", "train.deterministic=true")  # fmt: skip


def _train(run_dir: Path, fork: str) -> float:
    """`hpcml train --nproc 2` in a new interpreter; the CPU seconds of it, the agent it runs and
    the workers."""
    env = {**hpcml_env(), "HPCML_FORK_WORKERS": fork}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcml", "train", "examples/digits_cnn.yaml", *ARGS, "--nproc", "2",
         "--run-dir", str(run_dir), "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Terminating process" not in proc.stderr  # torch's log lines stay silenced
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_forked_workers_train_as_execd_ones_without_importing_again(tmp_path):
    forked, execd = tmp_path / "forked", tmp_path / "execd"
    cpu_forked, cpu_execd = _train(forked, "1"), _train(execd, "0")
    # Same ranks, data, gloo reductions and thread count: the same losses bit for bit.
    assert step_losses(forked) == step_losses(execd)
    assert sorted(step_losses(forked)) == [1, 2, 3]
    # Each exec'd worker imports torch, torch.distributed and the trainer again (2-3 CPU s each
    # here, as much as the parent's own start-up); a forked one starts with them imported:
    # forking must save at least a third of the run's CPU (measured: 4.5 vs 10.9 CPU s).
    # Workers silently exec'd again would not (seen: 11.0 vs 11.1).
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
