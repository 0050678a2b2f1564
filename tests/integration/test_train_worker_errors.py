"""Errors a user can cause, seen by `hpcml train --nproc 2` and by an external torchrun: one
sentence, exit code 2, no traceback, and no run folder named that does not exist.

The parent checks the whole resolved config before torchrun starts (model built on the meta
device, tp/heads/batch divisibility, data sizes); what only a worker can find (a user model
that refuses on one rank, a bad fault-injection spec) comes back from the worker as its
sentence through the launcher, with torchrun's own failure report left out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, hpcml_env, run_hpcml

pytestmark = pytest.mark.slow

CONFIG = "examples/digits_cnn.yaml"
FAST = ["train.max_steps=2", "train.eval_every=0", "data.batch_size=16"]


def _one_sentence(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


# (overrides, words the sentence must hold): each is found in the parent, before torchrun.
PARENT_CAUGHT = [
    (["parallel.tp=2"], ["parallel.tp 2", "tensor-parallel plan"]),
    (["data.batch_size=1000"], ["data.batch_size 1000", "1438 training samples"]),
    (["model.args={hiden: 3}"], ["hiden", "model.args"]),
    (["data.val_fraction=0.0"], ["0 validation samples", "data.val_fraction"]),
    (["parallel.sequence_parallel=true"], ["sequence_parallel", "parallel.tp > 1"]),
    (
        [
            "model.name=gpt-tiny",
            "model.args={n_head: 3, d_model: 96}",
            "parallel.tp=2",
            "data.source=synthetic",
            "data.synthetic_shape=[16]",
        ],
        ["parallel.tp 2", "n_head"],
    ),
    (["train.loss=nosuchpkg.losses:mine"], ["train.loss", "nosuchpkg"]),
]


@pytest.mark.parametrize(("overrides", "words"), PARENT_CAUGHT, ids=lambda v: str(v)[:40])
def test_parent_refuses_before_torchrun(tmp_path: Path, overrides: list[str], words: list[str]):
    run = tmp_path / "run"
    proc = run_hpcml(
        "train", CONFIG, *FAST, *overrides, "--nproc", "2", "--run-dir", str(run), check=False
    )
    line = _one_sentence(proc, *words)
    assert not run.exists() and str(run) not in line
    assert "torch.distributed" not in proc.stderr  # torchrun never started


def test_worker_only_errors_reach_the_user_as_their_sentence(tmp_path: Path):
    """Rank 1 alone refuses (rank 0 then breaks in a collective): rank 1's sentence, exit 2.
    A bad HPCML_FAULT_INJECT is found by every worker after the run folder exists."""
    run = tmp_path / "rank1"
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "model.name=tests.integration.worker_models:fails_on_rank1",
        "--nproc",
        "2",
        "--run-dir",
        str(run),
        check=False,
    )
    _one_sentence(proc, "refused on rank 1")
    assert "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr

    run = tmp_path / "inject"
    env = hpcml_env(HPCML_FAULT_INJECT='{"meteor": {}}')
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "model.name=mlp",
        "--nproc",
        "2",
        "--run-dir",
        str(run),
        check=False,
        env=env,
    )
    _one_sentence(proc, "HPCML_FAULT_INJECT", "meteor")
    assert "ChildFailedError" not in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["parallel.tp=2"], ["tensor-parallel plan"]),
        (["data.batch_size=1000"], ["data.batch_size 1000"]),
    ],
)
def test_external_torchrun_workers_say_one_sentence_and_exit_2(
    tmp_path: Path, overrides: list[str], words: list[str]
):
    """Under a user's own torchrun the workers check the same things before any collective:
    rank 0 prints the one sentence, every worker exits 2 (torchrun's own report is torchrun's:
    it lists exit code 2 and no worker traceback)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "hpcml",
        "train",
        CONFIG,
        *FAST,
        *overrides,
        "--run-dir",
        str(run),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=hpcml_env(), capture_output=True, text=True, timeout=300
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), proc.stderr[-3000:]
    assert "/hpcml/" not in proc.stderr.split("error:")[0]  # no frame of hpcml's code
    # torchrun's agent ends with its own report whatever the workers do: rank 0 names the
    # launcher that ends with the sentence alone (issue 29).
    assert "`python -m hpcml.launch.agent` takes the same arguments" in proc.stderr
    # torchrun SIGTERMs the other worker once the first exits; the first one exited 2.
    assert "exitcode  : 2" in proc.stderr.split("Root Cause")[1], proc.stderr[-3000:]
    assert not run.exists()
