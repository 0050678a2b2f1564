"""One rank's training exporter on loopback, read back with prometheus-client's own parser."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcml.errors import ConfigError
from hpcml.observe.train_metrics import TrainExporter


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_exporter_serves_flushed_records_writes_and_removes_its_target(tmp_path: Path) -> None:
    run = tmp_path / "myrun"
    ex = TrainExporter(0, "127.0.0.1", run, rank=3, local_rank=1, job="j7")
    try:
        target = json.loads((run / "prometheus" / "rank-3.json").read_text())
        assert target == [
            {
                "targets": [f"127.0.0.1:{ex.port}"],
                "labels": {"job": "j7", "run": "myrun", "rank": "3", "host": ex.host, "role": "train"},
            }
        ]
        recs = [
            {"step": s, "loss": 2.5 - s / 10, "lr": 0.01, "step_time_s": t, "data_wait_s": w,
             "samples_per_s": 64 / t}
            for s, t, w in [(1, 0.2, 0.05), (2, 0.3, 0.0), (3, 0.04, 0.01)]
        ]
        ex.update(recs, {"nonfinite_steps": 2, "rollbacks": 0}, {1: 4})
        got = scrape(ex.port)
        base = {"host": ex.host, "job": "j7", "rank": "3", "run": "myrun"}

        def at(name: str, **extra: str) -> float:
            return got[(name, tuple(sorted({**base, **extra}.items())))]

        assert at("hpcml_train_step") == 3
        assert at("hpcml_train_loss") == pytest.approx(2.2)  # the last record's
        assert at("hpcml_train_step_seconds_count") == 3
        assert at("hpcml_train_step_seconds_sum") == pytest.approx(0.54)
        # Bucket le=0.05 holds only the 0.04 s step; le=0.25 the 0.2 s one too.
        assert at("hpcml_train_step_seconds_bucket", le="0.05") == 1
        assert at("hpcml_train_step_seconds_bucket", le="0.25") == 2
        assert at("hpcml_train_data_wait_seconds_sum") == pytest.approx(0.06)
        assert at("hpcml_train_fault_events_total", event="nonfinite_steps") == 2
        assert at("hpcml_train_fault_events_total", event="rollbacks") == 0
        flagged = [k for k in got if k[0] == "hpcml_train_straggler_flags_total"]
        assert len(flagged) == 1 and at("hpcml_train_straggler_flags_total", straggler_rank="1") == 4

        # The same port again: one sentence naming it, not a traceback.
        with pytest.raises(ConfigError, match=f"cannot listen on port {ex.port}"):
            TrainExporter(ex.port - 1, "127.0.0.1", run, rank=0, local_rank=1)
    finally:
        ex.close(finished=True)
    assert not (run / "prometheus" / "rank-3.json").exists()  # finished: Prometheus lets go

    failed = TrainExporter(0, "127.0.0.1", run, rank=0, local_rank=0)
    failed.close(finished=False)
    assert (run / "prometheus" / "rank-0.json").exists()  # died: `up == 0` shows it


def test_a_shared_targets_folder_names_files_by_job_run_and_rank(tmp_path: Path) -> None:
    shared = tmp_path / "targets"
    ex = TrainExporter(0, "127.0.0.1", tmp_path / "r1", 1, 0, job="team/a b", targets_dir=shared)
    try:
        # A job name is not a safe file name: "/" would make a folder, " " is awkward.
        assert [p.name for p in shared.iterdir()] == ["team_a_b-r1-rank-1.json"]
        target = json.loads((shared / "team_a_b-r1-rank-1.json").read_text())
        assert target[0]["labels"]["job"] == "team/a b"  # the label keeps the real name
        assert not (tmp_path / "r1" / "prometheus").exists()
    finally:
        ex.close(finished=True)
    assert list(shared.iterdir()) == []


def test_an_unwritable_targets_folder_is_one_sentence(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot write its Prometheus target") as err:
        TrainExporter(0, "127.0.0.1", tmp_path / "r", 0, 0, targets_dir=blocker / "sub")
    assert "observe.targets_dir" in str(err.value)
