"""The alerting rules shipped in hpcml/observe/rules pass `promtool check rules`, and
`promtool test rules` (tests/unit/promtool/hpcml_rules_test.yaml) holds a case in which every
alert fires and one in which a healthy neighbour stays silent. A wrong threshold, a wrong label
or a broken template fails it (a data-starved threshold of 0.6 instead of 0.2 did)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from tests.conftest import system_binary

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "src" / "hpcml" / "observe" / "rules" / "hpcml.yaml"
CASES = ROOT / "tests" / "unit" / "promtool" / "hpcml_rules_test.yaml"


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    tool = system_binary("promtool", installer=".ci/install_prometheus.sh")
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run(
        [tool, "test", "rules", CASES.name], cwd=CASES.parent, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_alert_has_a_case_where_it_fires() -> None:
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    fired = {
        case["alertname"]
        for test in yaml.safe_load(CASES.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert len(alerts) >= 12
    assert alerts == fired, f"alerts without a firing case: {sorted(alerts - fired)}"
