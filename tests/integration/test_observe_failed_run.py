"""A training run whose work fails removes its Prometheus target as it ends (the preemption
path is tests/integration/test_observe_prometheus.py's, kill -9 tests/unit/test_observe_targets.py's);
`strict_health` on a CPU run says there is nothing to check."""

from __future__ import annotations

import json
from pathlib import Path

from fault_util import run_train, summary, write_config


def test_a_failed_run_removes_its_target(tmp_path: Path) -> None:
    targets = tmp_path / "targets"
    config = write_config(
        tmp_path / "c.yaml",
        train={"max_steps": 8, "checkpoint_every": 0},
        fault={"nan_policy": "stop"},
        observe={"metrics_port": 0, "metrics_address": "127.0.0.1", "targets_dir": str(targets),
                 "strict_health": True},
    )
    # A NaN loss at step 3 under nan_policy=stop: the run fails (exit 1) after its exporter
    # wrote its target.
    proc = run_train(config, tmp_path / "run", HPCML_FAULT_INJECT=json.dumps({"nan": {"step": 3}}))
    assert proc.returncode == 1, proc.stderr
    assert summary(tmp_path / "run")["status"] == "failed"
    assert targets.is_dir() and list(targets.iterdir()) == []
    # --strict-health on a CPU run says it had nothing to check (it said nothing at all).
    assert "observe.strict_health: this run trains on cpu" in proc.stderr
