"""A worker's user error under torchrun (issue 29): hpcml's agent (`python -m hpcml.launch.agent`,
`hpcml train --nproc`, `launch slurm`) ends with the worker's one sentence and its exit code;
torchrun's own agent cannot be made to (it raises ChildFailedError, a traceback and exit 1, for
any worker that fails), so there rank 0 says, after its sentence, what to run instead."""

from __future__ import annotations

import pytest

from hpcml.distributed.runtime import AGENT_ENV, WORKER_ERRORS_ENV, report_worker_error


def test_under_stock_torchrun_rank_0_names_the_agent_that_ends_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(AGENT_ENV, raising=False)
    monkeypatch.delenv(WORKER_ERRORS_ENV, raising=False)
    assert report_worker_error("config key 'train.seed' has value -1 ...", 2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "error: config key 'train.seed' has value -1 ..."
    assert len(lines) == 2 and "python -m hpcml.launch.agent" in lines[1]
    assert lines[1].endswith("exit code 2)")
    # Under hpcml's agent: the sentence alone (the agent ends with it and the exit code).
    monkeypatch.setenv(AGENT_ENV, "1")
    assert report_worker_error("bad", 2)
    assert capsys.readouterr().err.splitlines() == ["error: bad"]
    # Other ranks print nothing (rank 0 speaks for all).
    monkeypatch.delenv(AGENT_ENV)
    monkeypatch.setenv("RANK", "1")
    assert not report_worker_error("bad", 2)
    assert capsys.readouterr().err == ""


def test_a_config_error_under_stock_torchrun_gets_the_note_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A bad config key fails in the CLI before the Trainer (`hpcml.cli.common.fail`): the
    # commonest worker error, where the note was missing (seen with `torchrun -m hpcml train
    # examples/digits_cnn.yaml train.seed=-1`).
    from hpcml.cli.common import fail

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.delenv(AGENT_ENV, raising=False)
    monkeypatch.delenv(WORKER_ERRORS_ENV, raising=False)
    with pytest.raises(SystemExit) as stop:
        fail("config key 'train.seed' has value -1 ...", 2)
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: config key 'train.seed'")
    assert "python -m hpcml.launch.agent" in err and err.endswith("exit code 2)")
