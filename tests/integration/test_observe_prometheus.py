"""A real Prometheus (Debian's `prometheus`) scrapes a real 2-process training run that it found
only through the run's file_sd target files, and its HTTP query API returns the run's series
with the job/run/rank/host labels and values the run's own records agree with. After Ctrl-C
the targets stay and `up` drops to 0 for both ranks: what the HpcmlTrainingDown alert reads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fault_util import finish, records, start_train, wait_for, write_config

pytestmark = pytest.mark.slow


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is missing in CI; .ci/install_prometheus.sh should install it.")
        pytest.skip("prometheus is not installed (bash .ci/install_prometheus.sh installs it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(url: str, promql: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def start_prometheus(tmp: Path, targets: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "hpcml",
                        "honor_labels": True,
                        "file_sd_configs": [{"files": [str(targets / "*.json")], "refresh_interval": "1s"}],
                    }
                ],
            }
        )
    )
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "prometheus.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    wait_for("prometheus ready", ready, timeout=60, every=0.2)
    return proc, url


def by_rank(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_both_ranks_through_file_sd_and_sees_them_die(tmp_path: Path) -> None:
    run = tmp_path / "run"
    prom, url = start_prometheus(tmp_path, run / "prometheus")
    try:
        config = write_config(
            tmp_path / "c.yaml",
            train={"max_steps": 100_000, "checkpoint_every": 0, "log_every": 2},
            observe={"metrics_port": 0, "metrics_address": "127.0.0.1", "job": "itest"},
        )
        proc = start_train(config, run, "--nproc", "2")
        try:
            steps = wait_for(
                "both ranks scraped past step 4",
                lambda: (s := by_rank(query(url, 'hpcml_train_step{job="itest"}')))
                and len(s) == 2
                and min(s.values()) >= 4
                and s,
                timeout=180,
                every=0.5,
                proc=proc,
            )
            assert sorted(steps) == ["0", "1"]
            series = query(url, 'hpcml_train_step{job="itest"}')
            for s in series:
                labels = s["metric"]
                assert labels["run"] == "run" and labels["host"] == socket.gethostname(), labels
            logged = {r["step"]: r["loss"] for r in records(run)}
            loss = query(url, 'hpcml_train_loss{job="itest", rank="0"}')
            step0 = query(url, 'hpcml_train_step{job="itest", rank="0"}')
            # The scraped loss is one the run logged for a step it had flushed (not checked at
            # the same instant: the run moves on between the two queries).
            assert float(loss[0]["value"][1]) in set(logged.values())
            assert int(float(step0[0]["value"][1])) in logged
            counts = by_rank(query(url, 'hpcml_train_step_seconds_count{job="itest"}'))
            assert sorted(counts) == ["0", "1"] and min(counts.values()) >= 4
            skipped = by_rank(
                query(url, 'hpcml_train_fault_events_total{job="itest",event="skipped_steps"}')
            )
            assert skipped == {"0": 0.0, "1": 0.0}
            # Series the process collector exports carry the rank from the target file; a
            # Python process that imported torch holds far more than 50 MB.
            rss = by_rank(query(url, 'process_resident_memory_bytes{role="train",job="itest"}'))
            assert sorted(rss) == ["0", "1"] and min(rss.values()) > 50e6
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = finish(proc, 120)
        assert proc.returncode == 130, out
        # A run that did not finish leaves its targets: Prometheus sees both ranks down.
        assert sorted(p.name for p in (run / "prometheus").iterdir()) == ["rank-0.json", "rank-1.json"]
        down = wait_for(
            "up == 0 for both ranks",
            lambda: (d := by_rank(query(url, 'up{job="itest",role="train"} == 0'))) and len(d) == 2 and d,
            timeout=60,
            every=0.5,
        )
        assert sorted(down) == ["0", "1"]
    finally:
        prom.terminate()
        prom.wait(30)
