"""Target files live exactly as long as their process: runs whose folders share a name get a
file and series of their own (the run id); a process killed with SIGKILL leaves its file, which
the next exporter start and `hpcml observe up` prune; and a scrape meant for the dead process,
sent to whatever took its port, is refused (404) instead of reporting the newcomer under the
dead run's labels."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_observe_exporter import scrape

from hpcml.observe.stack import write_stack
from hpcml.observe.targets import write_target
from hpcml.observe.train_metrics import TrainExporter

SRC = Path(__file__).resolve().parents[2] / "src"

CHILD = """
import sys, time
from pathlib import Path
from hpcml.observe.train_metrics import TrainExporter
ex = TrainExporter(0, "127.0.0.1", Path(sys.argv[1]), 0, 0, job="A", targets_dir=Path(sys.argv[2]))
print(ex.port, flush=True)
time.sleep(600)
"""


def test_runs_whose_folders_share_a_name_get_their_own_targets_and_series(tmp_path: Path) -> None:
    shared = tmp_path / "targets"
    # exp1/run and exp2/run: the same folder name, so the same default job and run labels.
    one = TrainExporter(0, "127.0.0.1", tmp_path / "exp1" / "run", 0, 0, targets_dir=shared)
    two = TrainExporter(0, "127.0.0.1", tmp_path / "exp2" / "run", 0, 0, targets_dir=shared)
    try:
        assert one.run_id != two.run_id
        files = sorted(p.name for p in shared.iterdir())
        assert files == sorted(f"run-run-{ex.run_id}-rank-0.json" for ex in (one, two))
        for ex in (one, two):
            got = scrape(ex.port, ex.metrics_path)
            # Every series says which run it is, the process collector's too.
            ids = {dict(labels)["run_id"] for (name, labels) in got if name.startswith(("hpcml_", "process_"))}
            assert ids == {ex.run_id}
            assert any(name == "process_resident_memory_bytes" for name, _ in got)
    finally:
        one.close()
        two.close()
    assert list(shared.iterdir()) == []


def test_a_killed_runs_target_is_pruned_and_its_reused_port_refuses_its_scrape(tmp_path: Path) -> None:
    shared, watched = tmp_path / "targets", tmp_path / "watched"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "a" / "run"), str(shared)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        port = int(child.stdout.readline())  # type: ignore[union-attr]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    [dead] = list(shared.iterdir())
    entry = json.loads(dead.read_text())[0]
    dead_path = entry["labels"]["__metrics_path__"]
    watched.mkdir()
    (watched / "copy.json").write_text(dead.read_text())
    # Neighbours that must stay: a live process's target (this one's) and another host's.
    live = write_target(shared / "live.json", "127.0.0.1", 1, {"job": "C"})
    other = shared / "elsewhere.json"
    other.write_text(json.dumps([{**entry, "labels": {**entry["labels"], "__hpcml_host": "node-x"}}]))
    # This process's pid with another start time: a reused pid, its owner gone.
    reused = shared / "reused.json"
    reused.write_text(json.dumps([{**entry, "labels": {**entry["labels"], "__hpcml_pid": str(os.getpid()), "__hpcml_started": "1.0"}}]))
    assert dead.exists()  # a SIGKILL leaves the file: nothing ran to remove it

    new = TrainExporter(port, "127.0.0.1", tmp_path / "b" / "run", 0, 0, job="B", targets_dir=shared)
    try:
        assert new.port == port  # the dead run's port, taken by another run
        assert sorted(p.name for p in shared.iterdir()) == sorted(
            [live.name, new.target_file.name, other.name]
        )
        # Prometheus, still holding the dead target, scrapes its path: 404, so `up` is 0 for
        # the dead run rather than 1 with the newcomer's series under its labels.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{dead_path}", timeout=10)
        assert refused.value.code == 404
        jobs = {dict(labels)["job"] for (name, labels) in scrape(port, new.metrics_path) if name == "hpcml_train_step_seconds_count"}
        assert jobs == {"B"}
    finally:
        new.close()
    # `hpcml observe up` prunes the folders it watches too.
    write_stack(tmp_path / "stack", [watched])
    assert list(watched.iterdir()) == []
