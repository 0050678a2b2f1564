"""Every system program a test needs is installed by a `.ci/install_*.sh` that exists (`.ci/run`
runs them all before `make test`), and a missing one fails the test under CI=true but skips it,
naming that script, elsewhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from tests.conftest import ROOT, system_binary
from tests.e2e.slurm_cluster import CLIENTS, DAEMONS
from tests.integration.test_docs_commands import DOCS_TOOLS

INSTALLER = re.compile(r"\.ci/install_\w+\.sh")


def _system_binary_calls() -> list[tuple[str, str, str]]:
    """(test file, program, installer) for every `system_binary("prog", ..., installer="...")`
    with literal names in tests/."""
    out = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__):  # this file's own calls name a program nobody installs
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "system_binary"
            ):
                continue
            installer = next(k.value for k in node.keywords if k.arg == "installer")
            if isinstance(installer, ast.Constant) and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant):
                    out.append((str(path.relative_to(ROOT)), first.value, installer.value))
    return out


def _needs() -> list[tuple[str, str, str]]:
    return [
        *_system_binary_calls(),
        *[
            ("tests/integration/test_docs_commands.py", t, ".ci/install_docs_tools.sh")
            for t in DOCS_TOOLS
        ],
        *[("tests/e2e/test_slurm.py", p, ".ci/install_slurm.sh") for p in (*DAEMONS, *CLIENTS)],
    ]


def test_every_installer_named_in_the_tests_exists() -> None:
    named = {m for p in (ROOT / "tests").rglob("*.py") for m in INSTALLER.findall(p.read_text())}
    assert ".ci/install_docs_tools.sh" in named and ".ci/install_prometheus.sh" in named
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"tests name installers that do not exist: {missing}"


@pytest.mark.parametrize("where,program,installer", _needs(), ids=lambda v: str(v))
def test_the_installer_checks_for_the_program_it_must_provide(
    where: str, program: str, installer: str
) -> None:
    """The installer exits 0 early only when `command -v PROGRAM` finds it, and ends with the
    same check: a program it does not check for could be missing after a green install."""
    text = (ROOT / installer).read_text()
    checked = re.findall(r"command -v ([\w-]+)", text)
    assert program in checked, f"{where} needs {program}, which {installer} never checks for"


def _missing_program_outcome() -> BaseException:
    """What system_binary raises for a program nobody installs (a skip would otherwise skip
    the test that asks, instead of failing it)."""
    try:
        system_binary("hpcml-no-such-program", installer=".ci/install_docs_tools.sh")
    except (pytest.skip.Exception, pytest.fail.Exception) as e:
        return e
    raise AssertionError("system_binary returned a path for a program that does not exist")


def test_a_missing_program_skips_naming_its_installer_outside_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CI", raising=False)
    outcome = _missing_program_outcome()
    assert isinstance(outcome, pytest.skip.Exception), outcome
    assert "bash .ci/install_docs_tools.sh installs it" in str(outcome)


@pytest.mark.parametrize("value", ["true", "1", "yes"])
def test_a_missing_program_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    outcome = _missing_program_outcome()
    assert isinstance(outcome, pytest.fail.Exception), outcome
    assert ".ci/install_docs_tools.sh should install it" in str(outcome)
