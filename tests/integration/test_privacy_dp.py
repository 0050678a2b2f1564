"""DP-SGD (`privacy.dp_sgd`, Opacus) in real `hpcml train` runs on the digits demo.

Two processes with per-rank batch B train as one process with batch 2B, step by step: each
rank clips its samples' gradients, only rank 0 adds the noise, and the noisy sums are
all-reduced (noise on both ranks, a missing reduction or a wrong scale would each change the
losses by far more than summation order does; tests/unit/test_privacy_check.py checks the
clipping and the noise of one step against a hand computation). The epsilon of every step is Opacus's RDP accountant's after that many steps at a
sampling rate of global batch / training samples, in run.jsonl and summary.json. FSDP is
refused in one sentence with exit code 2 before any worker starts (no run folder is made).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import run_hpcml, step_losses, summary

CONFIG = "examples/digits_cnn.yaml"
DP = "privacy.dp_sgd={noise_multiplier: 1.0, max_grad_norm: 0.5, delta: 1.0e-5}"
COMMON = [
    "model.name=mlp",
    "model.args={hidden: 32}",
    "train.eval_every=0",
    "train.log_every=1",
    "train.max_steps=3",
    "train.deterministic=true",
    "--quiet",
]


def _epsilons(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "run.jsonl").read_text().splitlines()]
    return {r["step"]: r["epsilon"] for r in records if r.get("kind") == "step"}


@pytest.mark.slow
def test_dp_sgd_on_two_processes_equals_one_with_twice_the_batch(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    run_hpcml("train", CONFIG, *COMMON, DP, "data.batch_size=32", "--run-dir", str(one))
    run_hpcml("train", CONFIG, *COMMON, DP, "data.batch_size=16", "--nproc", "2",
              "--run-dir", str(two))  # fmt: skip
    a, b = step_losses(one), step_losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        # fp32 sums of clipped gradients in another order (gloo allreduce): as the DDP test of
        # test_train_run.py, 1e-5 (~170 u) is an estimate, not a derived bound. Noise added on
        # both ranks, or sums scaled by the per-rank batch alone, move step 2's loss far more.
        assert a[s] == pytest.approx(b[s], rel=1e-5), (s, a[s], b[s])

    from opacus.accountants import RDPAccountant

    s = summary(two)["privacy"]
    assert s["sample_rate"] == 32 / summary(two)["data"]["train_samples"]
    expected = {}
    for step in (1, 2, 3):
        accountant = RDPAccountant()
        accountant.history = [(1.0, s["sample_rate"], step)]
        expected[step] = accountant.get_epsilon(1e-5)
    eps = _epsilons(two)
    assert eps == pytest.approx(expected, rel=1e-12) and eps[1] < eps[2] < eps[3]
    assert s["epsilon"] == eps[3] and s["noise_multiplier"] == 1.0 and s["steps"] == 3
    assert _epsilons(one) == eps  # the same global batch, the same privacy spent


def test_dp_sgd_with_fsdp_is_refused_before_workers_start(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_hpcml("train", CONFIG, *COMMON, DP, "parallel.strategy=fsdp", "--nproc", "2",
                     "--run-dir", str(run), check=False)  # fmt: skip
    message = proc.stderr.strip()
    assert proc.returncode == 2, message
    assert len(message.splitlines()) == 1, message
    assert "privacy.dp_sgd cannot train this run" in message
    assert "parallel.strategy=fsdp" in message
    assert not run.exists()
