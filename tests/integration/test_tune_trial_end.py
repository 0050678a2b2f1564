"""A trial that has trained all its steps is complete, whatever the pruner says at its final
evaluation (hpcml.tune.trial.run).

A verdict at the last step saves no step, and the SIGINT that carried it reached `hpcml train`
in its last moments (writing its summary, after its final checkpoint), so the run ended
`interrupted` and the trial was recorded pruned, its final value lost: the benchmark's rung at
step 60, the end, did that. The run is a stand-in that writes what `hpcml train` writes to its
`run.jsonl` and `summary.json` and, like it, ends `interrupted` (exit 130) when SIGINT comes
after its last step; the tuner's side is the real one, started through the same guard process
as every trial.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpcml.tune import trial

WAIT_S = 60.0
"""Bound on a stand-in's wait for the tuner's verdict or SIGINT (fails instead of hanging)."""
AFTER_VERDICT_S = 0.5
"""How long a stand-in that was judged at its last step waits for a SIGINT before it writes
its summary: the tuner sends one right after its verdict if it sends one at all (the verdict
is written to a file just before report() returns, and the signal follows in the same thread),
so a wait this long sees it on a busy machine too."""

RUN = r"""
import json, signal, sys, time
from pathlib import Path
out, scenario, wait_s, after_s = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
got = []
signal.signal(signal.SIGINT, lambda *_: got.append(1))
log = open(out / "run.jsonl", "a")
def write(rec):
    log.write(json.dumps(rec) + "\n")
    log.flush()
def train(first, last):
    for step in range(first, last + 1):
        write({"kind": "step", "step": step})
        if step % 20 == 0:
            write({"kind": "eval", "step": step, "val_accuracy": step / 100})
def wait(what, seconds, bound=True):
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline:
        time.sleep(0.01)
    if bound and not what():
        (out / "gave_up").write_text("")
def end(status, code):
    summary = {"status": status, "final": {"val_accuracy": 0.6}}
    (out / "summary.json").write_text(json.dumps(summary))
    sys.exit(code)
if scenario == "judged at the end":  # the verdict comes with the evaluation at step 60
    train(1, 60)
    wait(lambda: (out / "verdict").exists(), wait_s)
    wait(lambda: got, after_s, bound=False)
    (out / "signalled").write_text(str(len(got)))
    end("interrupted", 130) if got else end("finished", 0)
wait_for_sigint_after = 40 if scenario == "ahead of the tuner" else 20
train(1, wait_for_sigint_after)
wait(lambda: got, wait_s)
if scenario == "ahead of the tuner":  # it trained on while the tuner decided at step 40
    train(41, 60)
end("interrupted", 130)  # the SIGINT came after its last step, or at step 20 (pruned)
"""


def _run(tmp_path: Path, scenario: str, prune_at: int) -> tuple[trial.Outcome, list[int]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    judged: list[int] = []

    def report(points: list[tuple[int, float]]) -> bool:
        judged.extend(step for step, _ in points)
        if points[-1][0] < prune_at:
            return False
        (run_dir / "verdict").write_text("prune")
        return True

    command = [sys.executable, "-c", RUN, str(run_dir), scenario, str(WAIT_S), str(AFTER_VERDICT_S)]
    outcome = trial.run(command, run_dir, "val_accuracy", report, last_step=60)
    assert not (run_dir / "gave_up").exists(), "the stand-in waited out its bound"
    return outcome, judged


def test_a_trial_judged_at_its_last_step_is_complete_and_its_run_not_stopped(tmp_path: Path):
    outcome, judged = _run(tmp_path, "judged at the end", prune_at=60)
    assert (outcome.state, outcome.value, outcome.steps) == ("complete", 0.6, 60)
    assert (tmp_path / "run" / "signalled").read_text() == "0"  # no SIGINT was sent
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"
    assert judged == [20, 40, 60]


@pytest.mark.parametrize(
    ("scenario", "prune_at", "expected"),
    [
        # Judged at step 40, but the run had evaluated its step 60 when the SIGINT reached it:
        # complete, with the value of its last evaluation, which is reported too.
        ("ahead of the tuner", 40, ("complete", 0.6, 60, 60)),
        # Judged at step 20 and stopped there: pruned, as before.
        ("pruned", 20, ("pruned", 0.2, 20, 20)),
    ],
)
def test_a_stopped_run_is_pruned_unless_it_had_evaluated_its_last_step(
    tmp_path: Path, scenario: str, prune_at: int, expected: tuple[object, ...]
):
    outcome, judged = _run(tmp_path, scenario, prune_at)
    assert (outcome.state, outcome.value, outcome.step, outcome.steps) == expected
    assert judged == list(range(20, expected[3] + 1, 20))  # type: ignore[operator]
