"""The alerting rules shipped in hpcml/observe/rules pass `promtool check rules`, and
`promtool test rules` (tests/unit/promtool/hpcml_rules_test.yaml) holds a case in which every
alert fires and one in which a healthy neighbour stays silent. A wrong threshold, a wrong label
or a broken template fails it (a data-starved threshold of 0.6 instead of 0.2 did)."""

from __future__ import annotations

import json
import re
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


def _rules() -> dict[str, dict[str, object]]:
    return {
        rule["alert"]: rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def test_every_rule_links_its_section_of_the_runbooks_page() -> None:
    page = (ROOT / "docs" / "guides" / "runbooks.md").read_text()
    headings = {line[3:].strip() for line in page.splitlines() if line.startswith("## ")}
    for name, rule in _rules().items():
        url = rule["annotations"]["runbook_url"]  # type: ignore[index]
        # MkDocs' anchor of a heading "## HpcmlX" is "hpcmlx".
        assert url == f"docs/guides/runbooks.md#{name.lower()}", name
        assert name in headings, f"{name} has no section in runbooks.md"


def test_the_error_ratio_counts_every_failure_code_the_server_answers() -> None:
    """504 -> DEADLINE_EXCEEDED and 413 -> RESOURCE_EXHAUSTED made half of a model's gRPC
    requests fail with no alert when the rule matched only 5xx, INTERNAL and UNAVAILABLE."""
    from hpcml.serve.metrics import GRPC_CODE_OF_HTTP

    expr = str(_rules()["HpcmlServerErrors"]["expr"])
    codes = re.search(r'code=~"([^"]+)"', expr).group(1)  # type: ignore[union-attr]
    client_mistakes = {400, 404}
    failures = {str(s) for s in GRPC_CODE_OF_HTTP if s not in client_mistakes}
    failures |= {c for s, c in GRPC_CODE_OF_HTTP.items() if s not in client_mistakes}
    failures |= {"500", "502", "UNKNOWN"}  # any 5xx; the code of an unmapped status
    for code in sorted(failures):
        assert re.fullmatch(codes, code), f"{code} is a failure the rule does not count"
    for code in ("200", "OK", "400", "INVALID_ARGUMENT", "404", "NOT_FOUND"):
        assert not re.fullmatch(codes, code), f"{code} counted as the server failing"
    # The serving dashboard's error-ratio panel counts the same codes.
    board = json.loads((ROOT / "src/hpcml/observe/dashboards/serving.json").read_text())
    panel = [t["expr"] for p in board["panels"] if p["title"] == "Error ratio" for t in p["targets"]]
    assert panel and all(f'code=~"{codes}"' in e for e in panel)


def test_alertmanager_routes_each_rule_to_the_receiver_its_severity_names(tmp_path: Path) -> None:
    from hpcml.observe.stack import write_stack

    amtool = system_binary("amtool", installer=".ci/install_alertmanager.sh")
    write_stack(tmp_path, [tmp_path / "targets"], docs_url="https://docs.example/hpcml/")
    config = tmp_path / "alertmanager.yml"
    check = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    for name, rule in _rules().items():
        severity = rule["labels"]["severity"]  # type: ignore[index]
        routed = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={config}",
             f"alertname={name}", f"severity={severity}", "job=j", "run=r"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert routed.returncode == 0, routed.stderr
        assert routed.stdout.split() == ["oncall" if severity == "critical" else "team"], name
    # --docs-url points the runbook links at the published page.
    written = yaml.safe_load((tmp_path / "rules" / "hpcml.yaml").read_text())
    urls = {r["annotations"]["runbook_url"] for g in written["groups"] for r in g["rules"]}
    assert urls == {
        f"https://docs.example/hpcml/guides/runbooks/#{name.lower()}" for name in _rules()
    }
