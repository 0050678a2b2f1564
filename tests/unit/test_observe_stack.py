"""`hpcml observe up` writes a Prometheus configuration that promtool accepts (with the rules),
Grafana provisioning with the shipped dashboards, and a compose file that mounts the watched
folders at their own paths (the file_sd globs name them) and that the Compose Specification's
JSON schema accepts (tests/compose_schema: the file, its commit, URL and sha256; no Docker runs
here to start it)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft7Validator
from tests.conftest import run_hpcml, system_binary

from hpcml.observe.stack import write_stack

DASHBOARDS = Path(__file__).resolve().parents[2] / "src" / "hpcml" / "observe" / "dashboards"
COMPOSE_SCHEMA = Path(__file__).resolve().parents[1] / "compose_schema"


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


def compose_errors(doc: dict[str, Any]) -> list[str]:
    """`doc` against the vendored Compose Specification schema, after checking the file is the
    one SOURCES.json records."""
    source = json.loads((COMPOSE_SCHEMA / "SOURCES.json").read_text())
    raw = (COMPOSE_SCHEMA / source["file"]).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == source["sha256"]
    # Draft 7, as the schema declares (its "https://json-schema.org/draft-07/schema" spelling is
    # not one jsonschema maps to a draft by itself).
    validator = Draft7Validator(json.loads(raw))
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_observe_up_compose_file_matches_the_compose_spec(tmp_path: Path) -> None:
    runs, served = tmp_path / "targets", tmp_path / "serve"
    write_stack(tmp_path / "stack", [runs, served])
    doc = yaml.safe_load((tmp_path / "stack" / "docker-compose.yml").read_text())
    assert sorted(doc["services"]) == ["alertmanager", "grafana", "prometheus"]
    assert compose_errors(doc) == []
    # The check can fail: a misspelt key, a volume list written as a mapping.
    misspelt = copy.deepcopy(doc)
    prometheus = misspelt["services"]["prometheus"]
    prometheus["network-mode"] = prometheus.pop("network_mode")
    assert compose_errors(misspelt)
    mapping = copy.deepcopy(doc)
    mapping["services"]["grafana"]["volumes"] = {"./grafana": "/etc/grafana"}
    assert compose_errors(mapping)


def test_dashboard_queries_name_only_their_own_variables() -> None:
    """A panel query naming a variable its dashboard does not define gets the literal `$name`
    from Grafana, and no data (the Prometheus test substitutes every variable by name, so it
    cannot see this)."""
    for board_file in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(board_file.read_text())
        defined = {v["name"] for v in board["templating"]["list"]}
        queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
        queries += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
        used = {m for q in queries for m in re.findall(r"\$(\w+)", q) if not m.startswith("__")}
        assert used and used <= defined, (board_file.name, used - defined)
