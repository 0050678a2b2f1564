"""One rank's training exporter on loopback, read back with prometheus-client's own parser."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.fake_nvml import FakeNvml

from hpcml.errors import ConfigError
from hpcml.observe.train_metrics import TrainExporter, run_id_of


def scrape(port: int, path: str = "/metrics") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
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
        assert ex.run_id == run_id_of(run) and len(ex.run_id) == 12
        assert target == [
            {
                "targets": [f"127.0.0.1:{ex.port}"],
                "labels": {
                    "job": "j7", "run": "myrun", "run_id": ex.run_id, "rank": "3",
                    "host": ex.host, "role": "train",
                    "__metrics_path__": f"/metrics/{ex.run_id}/rank-3",
                    "__hpcml_host": ex.host, "__hpcml_pid": str(os.getpid()),
                    "__hpcml_started": f"{psutil.Process().create_time():.3f}",
                },
            }
        ]
        recs = [
            {"step": s, "loss": 2.5 - s / 10, "lr": 0.01, "step_time_s": t, "data_wait_s": w,
             "samples_per_s": 64 / t}
            for s, t, w in [(1, 0.2, 0.05), (2, 0.3, 0.0), (3, 0.04, 0.01)]
        ]
        ex.update(recs, {"nonfinite_steps": 2, "rollbacks": 0}, {1: 4})
        got = scrape(ex.port)
        base = {"host": ex.host, "job": "j7", "rank": "3", "run": "myrun", "run_id": ex.run_id}

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
        ex.close()
    assert not (run / "prometheus" / "rank-3.json").exists()  # gone: Prometheus lets go


def test_a_shared_targets_folder_names_files_by_job_run_and_rank(tmp_path: Path) -> None:
    shared = tmp_path / "targets"
    ex = TrainExporter(0, "127.0.0.1", tmp_path / "r1", 1, 0, job="team/a b", targets_dir=shared)
    try:
        # A job name is not a safe file name: "/" would make a folder, " " is awkward.
        name = f"team_a_b-r1-{ex.run_id}-rank-1.json"
        assert [p.name for p in shared.iterdir()] == [name]
        target = json.loads((shared / name).read_text())
        assert target[0]["labels"]["job"] == "team/a b"  # the label keeps the real name
        assert not (tmp_path / "r1" / "prometheus").exists()
    finally:
        ex.close()
    assert list(shared.iterdir()) == []


def test_an_unwritable_targets_folder_is_one_sentence(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot write its Prometheus target") as err:
        TrainExporter(0, "127.0.0.1", tmp_path / "r", 0, 0, targets_dir=blocker / "sub")
    assert "observe.targets_dir" in str(err.value)


def test_gpu_series_from_an_injected_nvml_and_the_rank_info(tmp_path: Path) -> None:
    ex = TrainExporter(0, "127.0.0.1", tmp_path / "g", 0, 1, job="j", gpu_index=0,
                       nvml=FakeNvml(), gpu_uuid="GPU-fake")  # fmt: skip
    try:
        got = scrape(ex.port)
        base = {"host": ex.host, "job": "j", "rank": "0", "run": "g", "run_id": ex.run_id}
        gpu = {**base, "gpu": "0", "uuid": "GPU-fake"}

        def at(name: str, labels: dict[str, str], **extra: str) -> float:
            return got[(name, tuple(sorted({**labels, **extra}.items())))]

        assert at("hpcml_gpu_utilization_ratio", gpu) == pytest.approx(0.87)
        assert at("hpcml_gpu_memory_used_bytes", gpu) == 3 * 2**30
        assert at("hpcml_gpu_power_watts", gpu) == pytest.approx(312.5)
        assert at("hpcml_gpu_sm_clock_hertz", gpu) == pytest.approx(1.41e9)
        assert at("hpcml_gpu_ecc_errors_total", gpu, kind="uncorrected") == 2
        assert at("hpcml_gpu_ecc_errors_total", gpu, kind="corrected") == 12
        assert at("hpcml_gpu_retired_pages", gpu, cause="double_bit") == 3
        assert at("hpcml_gpu_retired_pages", gpu, cause="single_bit") == 1
        assert at("hpcml_gpu_retired_pages_pending", gpu) == 1
        # One series per reason NVML knows: 1 for the two active ones, 0 for the others.
        reasons = {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "hpcml_gpu_clock_event_active"}
        assert {r for r, v in reasons.items() if v == 1} == {"HwThermalSlowdown", "SwPowerCap"}
        assert len(reasons) > 5 and set(reasons.values()) == {0.0, 1.0}
        # Not supported on this GPU: left out, not reported as 0.
        assert not [k for k in got if k[0] == "hpcml_gpu_row_remap_pending"]
        assert at("hpcml_rank_info", base, gpu_uuid="GPU-fake") == 1
        # Local rank 1: the host's series come from local rank 0 only.
        assert not [k for k in got if k[0].startswith("hpcml_host_")]
    finally:
        ex.close()


def test_checkpoint_eval_grad_norm_restart_and_host_series(tmp_path: Path) -> None:
    ex = TrainExporter(0, "127.0.0.1", tmp_path / "h", 0, 0, job="j")
    try:
        ex.started(2.5, {"resume": 2, "preemption": 1, "elastic": 0})
        ex.checkpointed(0.3)
        ex.checkpointed(40.0)
        ex.evaluated({"val_loss": 0.25, "val_accuracy": 0.875, "note": "text is left out"})
        ex.update([{"step": 4, "loss": 1.0, "step_time_s": 0.1, "data_wait_s": 0.0,
                    "grad_norm": 3.5}], {"skipped_steps": 1})  # fmt: skip
        before = psutil.cpu_times()
        got = scrape(ex.port)
        base = {"host": ex.host, "job": "j", "rank": "0", "run": "h", "run_id": ex.run_id}

        def at(name: str, **extra: str) -> float:
            return got[(name, tuple(sorted({**base, **extra}.items())))]

        assert at("hpcml_train_checkpoint_seconds_count", op="save") == 2
        assert at("hpcml_train_checkpoint_seconds_sum", op="save") == pytest.approx(40.3)
        assert at("hpcml_train_checkpoint_seconds_bucket", op="save", le="0.5") == 1
        assert at("hpcml_train_checkpoint_seconds_count", op="load") == 1
        assert at("hpcml_train_checkpoint_seconds_sum", op="load") == 2.5
        assert at("hpcml_train_eval_metric", metric="val_accuracy") == 0.875
        assert not [k for k in got if dict(k[1]).get("metric") == "note"]
        assert at("hpcml_train_grad_norm") == 3.5
        assert at("hpcml_train_restarts_total", kind="resume") == 2
        assert at("hpcml_train_restarts_total", kind="preemption") == 1
        assert at("hpcml_train_fault_events_total", event="skipped_steps") == 1
        assert at("hpcml_rank_info", gpu_uuid="") == 1
        # Host CPU seconds by mode: psutil's counters, read at the scrape (after `before`).
        assert at("hpcml_host_cpu_seconds_total", mode="user") >= before.user
        assert at("hpcml_host_network_sent_bytes_total") > 0
        assert at("hpcml_train_flush_interval_seconds") > 0
    finally:
        ex.close()
