"""Roles and the audit log's hash chain without a server (issue 39, items 2-3): which role each
endpoint needs, what a token may do, the tokens file's mistakes, and a chain that several
processes append to at once and that names the first line edited, deleted or moved."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.conftest import run_hpcml

from hpcml.errors import ConfigError
from hpcml.serve.tokens import (
    BODY,
    Authorizer,
    Refusal,
    load_tokens,
    model_in_path,
    required_role,
)
from hpcml.track.audit import AuditLog, verify


@pytest.mark.parametrize(
    ("method", "path", "need"),
    [
        ("GET", "/v2/health/live", "open"),
        ("GET", "/v2/health/ready", "open"),
        ("POST", "/v2/models/digits/infer", "infer"),
        ("POST", "/v2/models/digits/versions/2/infer", "infer"),
        ("POST", "/v2/models/tiny/generate_stream", "infer"),
        ("POST", "/v1/completions", "infer"),
        ("POST", "/v1/chat/completions", "infer"),
        ("GET", "/v2", "meta"),
        ("GET", "/v2/models/digits", "meta"),
        ("GET", "/v2/models/digits/versions/2/ready", "meta"),
        ("GET", "/v1/models", "meta"),
        ("GET", "/metrics", "read"),
        ("GET", "/v2/models/digits/stats", "read"),
        ("GET", "/v2/models/digits/config", "read"),
        ("POST", "/v2/repository/index", "read"),
        ("GET", "/admin/models/digits", "admin_read"),
        ("GET", "/docs", "read"),
        ("POST", "/admin/models/digits/traffic", "admin"),
        ("POST", "/admin/models/digits/rollback", "admin"),
        ("DELETE", "/admin/models/digits", "admin"),
        ("GET", "/v2/models/digits/infer", "read"),  # not an inference call: no infer pass
    ],
)
def test_each_endpoint_needs_its_role(method: str, path: str, need: str) -> None:
    assert required_role(method, path) == need


def test_models_named_by_paths() -> None:
    assert model_in_path("/v2/models/digits/versions/2/infer") == "digits"
    assert model_in_path("/admin/models/digits/traffic") == "digits"
    assert model_in_path("/v2/models/stats") is None  # every model's statistics
    assert model_in_path("/metrics") is None
    assert model_in_path("/v1/chat/completions") is BODY  # the handler checks the body's model


def _file(tmp_path: Path, entries: list[dict[str, object]]) -> Path:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": entries}))  # JSON is YAML too
    return path


def _entry(name: str, roles: list[str], **extra: object) -> dict[str, object]:
    return {"name": name, "sha256": hashlib.sha256(name.encode()).hexdigest(), "roles": roles,
            **extra}  # fmt: skip


def test_the_authorizer_decides_by_role_scope_and_rate(tmp_path: Path) -> None:
    principals = load_tokens(_file(tmp_path, [
        _entry("ops", ["admin"]), _entry("app", ["infer"]), _entry("dash", ["read"]),
        _entry("scoped", ["infer", "read"], models=["digits"]),
        _entry("slow", ["infer"], rate_limit={"requests_per_s": 0.001, "burst": 1}),
    ]))  # fmt: skip
    auth = Authorizer(principals, admin_token="old-admin-token")

    def status(token: str | None, need: str, model: str | None = "digits") -> int | str:
        try:
            return auth.check(token, need, model, "do it").name  # type: ignore[arg-type]
        except Refusal as refusal:
            return refusal.status

    assert status("ops", "admin") == "ops" and status("ops", "infer") == "ops"
    assert status("old-admin-token", "admin") == "admin-token"  # --admin-token-env still works
    assert status(None, "infer") == 401 and status("nobody", "infer") == 401
    assert status("app", "infer") == "app" and status("app", "meta") == "app"
    assert status("app", "read") == 403 and status("app", "admin") == 403
    assert status("dash", "read") == "dash" and status("dash", "infer") == 403
    assert status("dash", "admin_read") == "dash" and status("app", "admin_read") == 403
    assert status("scoped", "infer") == "scoped" and status("scoped", "infer", "tiny") == 403
    assert status("scoped", "read", None) == 403 and status("scoped", "meta", None) == "scoped"
    assert status("scoped", "infer", BODY) == "scoped"  # /v1/completions: checked on its body
    assert status(None, "open") == "anonymous"
    assert [status("slow", "infer") for _ in range(3)] == ["slow", 429, 429]


def test_without_a_tokens_file_only_admin_asks_for_a_token() -> None:
    open_server = Authorizer([], admin_token=None)
    assert open_server.check(None, "infer", "m", "x").name == "anonymous"
    assert open_server.check("anything", "read", None, "x").name == "anonymous"
    for need in ("admin", "admin_read"):  # the admin endpoints' reads were never open
        with pytest.raises(Refusal, match="admin endpoints are disabled") as off:
            open_server.check("anything", need, "m", "x")  # type: ignore[arg-type]
        assert off.value.status == 403
    with_admin = Authorizer([], admin_token="s3cret")
    with pytest.raises(Refusal, match="sent an unknown token") as wrong:
        with_admin.check("nope", "admin", "m", "x")
    assert wrong.value.status == 401
    assert with_admin.check("s3cret", "admin", "m", "x").name == "admin-token"
    with pytest.raises(Refusal, match="sent no token"):
        with_admin.check(None, "admin_read", None, "x")


@pytest.mark.parametrize(
    ("content", "sentence"),
    [
        ("tokens: [", "is not readable YAML or JSON"),
        ("- a\n- b\n", "(top level) is not allowed"),
        ('{"tokens": [{"name": "a", "sha256": "abc", "roles": ["infer"]}]}',
         "tokens.0.sha256 is not allowed"),
        (json.dumps({"tokens": [_entry("a", ["root"])]}), "tokens.0.roles.0 is not allowed"),
        (json.dumps({"tokens": [_entry("a", ["infer"], colour="red")]}),
         "tokens.0.colour is not allowed"),
        (json.dumps({"tokens": [_entry("a", ["infer"]), _entry("a", ["read"])]}),
         "names 'a' twice"),
    ],
)  # fmt: skip
def test_tokens_file_mistakes_are_one_sentence(tmp_path: Path, content: str, sentence: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_tokens(path)
    assert sentence in err.value.message and "\n" not in err.value.message


def _append_many(path: str, writer: int, count: int) -> None:
    log = AuditLog(path)
    for i in range(count):
        log.append(f"writer-{writer}", "traffic", "digits", f"change {i}", n=i)


def test_concurrent_appenders_keep_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    # Forked from this process: the writers need nothing but the standard library.
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_append_many, args=(str(path), w, 40)) for w in range(4)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    verdict = verify(path)
    assert verdict.intact, verdict.problem
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["seq"] for r in records] == list(range(1, 161))
    for w in range(4):  # each writer's records, all there, in its own order
        mine = [r["details"]["n"] for r in records if r["actor"] == f"writer-{w}"]
        assert mine == list(range(40))


def _chain(path: Path, n: int = 5) -> list[str]:
    log = AuditLog(path)
    for i in range(n):
        log.append("ops", "traffic", "digits", f"step {i}", share=i / 10)
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize(
    ("tamper", "line", "problem"),
    [
        (lambda ls: [*ls[:2], ls[2].replace('"step 2"', '"step 9"'), *ls[3:]], 3, "edited"),
        (lambda ls: [ls[0], *ls[2:]], 2, "deleted, inserted or moved"),
        (lambda ls: [*ls[:2], ls[3], ls[2], ls[4]], 3, "deleted, inserted or moved"),
        (lambda ls: [ls[1], ls[0], *ls[2:]], 1, "deleted, inserted or moved"),
        (lambda ls: [*ls[:4], ls[4][:30] + "\n"], 5, "not a JSON record"),
    ],
)
def test_verify_names_the_first_broken_line(
    tmp_path: Path, tamper: Callable[[list[str]], list[str]], line: int, problem: str
) -> None:
    path = tmp_path / "audit.jsonl"
    lines = _chain(path)
    assert verify(path).intact and verify(path).records == 5
    path.write_text("".join(tamper(lines)))
    verdict = verify(path)
    assert (verdict.broken_line, verdict.records) == (line, line - 1)
    assert problem in verdict.problem


def test_audit_verify_command_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = _chain(path, 3)
    intact = run_hpcml("audit", "verify", str(path), "--json")
    assert json.loads(intact.stdout)["records"] == 3
    path.write_text(lines[0] + lines[2])
    broken = run_hpcml("audit", "verify", str(path), check=False)
    assert broken.returncode == 1
    assert broken.stdout.strip() == (
        f"broken: line 2 of {path} breaks the chain: it does not follow the record before it "
        "(a record was deleted, inserted or moved before it)."
    )
    missing = run_hpcml("audit", "verify", str(tmp_path / "nope.jsonl"), check=False)
    assert missing.returncode == 2 and "is not a file" in missing.stderr
