"""`hpcml observe up` writes a Prometheus configuration that promtool accepts (with the rules),
Grafana provisioning with the shipped dashboards, and a compose file that mounts the watched
folders at their own paths (the file_sd globs name them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from tests.conftest import run_hpcml, system_binary

DASHBOARDS = Path(__file__).resolve().parents[2] / "src" / "hpcml" / "observe" / "dashboards"


def test_observe_up_writes_a_stack_promtool_accepts(tmp_path: Path) -> None:
    runs, served, out = tmp_path / "targets", tmp_path / "serve", tmp_path / "stack"
    runs.mkdir()
    shown = json.loads(
        run_hpcml("observe", "up", "--targets", str(runs), "--targets", str(served), "--out",
                  str(out), "--scrape-s", "2", "--json").stdout
    )
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["honor_labels"] is True
    assert job["file_sd_configs"][0]["files"] == [f"{runs}/*.json", f"{served}/*.json"]
    assert config["global"]["scrape_interval"] == "2s"
    assert len(shown["alert_rules"]) == 14
    # Alerts go to the Alertmanager the compose file runs, configured from alertmanager.yml.
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["localhost:9093"]
    assert (out / "alertmanager.yml").is_file()
    for board in DASHBOARDS.glob("*.json"):
        assert (out / "grafana" / "dashboards" / board.name).read_bytes() == board.read_bytes()
    compose = yaml.safe_load((out / "docker-compose.yml").read_text())
    volumes = compose["services"]["prometheus"]["volumes"]
    assert f"{runs}:{runs}:ro" in volumes and f"{served}:{served}:ro" in volumes
    source = yaml.safe_load((out / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://localhost:9090"

    promtool = system_binary("promtool", installer=".ci/install_prometheus.sh")
    check = subprocess.run([promtool, "check", "config", str(out / "prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "14 rules found" in check.stdout


def test_observe_up_without_targets_is_one_sentence(tmp_path: Path) -> None:
    proc = run_hpcml("observe", "up", "--out", str(tmp_path / "s"), check=False)
    assert proc.returncode == 2 and "needs --targets" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "s").exists()
