"""Every verb of the `hpcml` command under generated hostile options (issue 19).

The commands are discovered from the typer application, so a verb added later is fuzzed
without anyone adding it here. For each command Hypothesis draws argument lists from each
parameter's declared type: paths that do not exist, are files where folders are expected, are
folders where files are expected, sit under a file or in /proc; negative, zero, NaN, infinite
and enormous numbers; empty, huge, unicode and malformed strings; and a few valid words so that
deeper code is reached. Each list runs in-process through the CLI runner.

The property, for every example: exit code 0, 1 or 2; a negative or non-finite number given to
a numeric option is refused with 2 (unless the option is one of `SIGNED`); nothing escapes as an
exception (a traceback); at most a few lines on stderr; no file appears outside the example's
temporary folder.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.main import get_command
from typer.testing import CliRunner

from conftest import examples
from hpcml.cli.app import app

ROOT = get_command(app)
REPO = Path(__file__).resolve().parents[2]

# Numeric options where a negative value means something (none today).
SIGNED: set[tuple[str, str]] = set()
# Seconds one example may take before it counts as a hang (a verb that starts real work on
# hostile input, or a loop over an enormous number). Far above any refusal's cost.
HANG_S = 60


def leaf_commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for name, sub in sorted(group.commands.items()):
        if hasattr(sub, "commands"):
            out += leaf_commands(sub, (*path, name))
        else:
            out.append(((*path, name), sub))
    return out


COMMANDS = leaf_commands(ROOT)

# --- inputs -----------------------------------------------------------------------------------

PATHS = [
    "missing/nothing",  # does not exist
    "notes.txt",  # a text file where a folder or a config is expected
    "notes.txt/sub",  # under a file: can never be created
    "blob.bin",  # binary garbage
    "bad.yaml",  # YAML with a syntax error
    "list.yaml",  # YAML whose top level is a list
    "unknown.yaml",  # valid YAML, unknown keys
    "emptydir",  # a folder where a file is expected
    "/proc/hpcml-fuzz/x",  # cannot be created
    "",
]
# Output folders: only ones that can never be written. A writable one means real work
# (`data prepare` tokenizes the standard library), which the data tests cover.
UNWRITABLE = ["notes.txt/sub", "/proc/hpcml-fuzz/x", "notes.txt", "blob.bin"]
OUTPUT_PARAMS = {"out"}
WORDS = [
    "", " ", "x" * 300, "../../../etc/passwd", "é漢字", "{}", "{", "[]", "null", '{"hidden": -1}',
    "mlp", "gpt", "simple_cnn", "llama-7b", "gpt2-small", "h100-sxm", "a100-80gb", "hgx-h100",
    "digits", "pystdlib", "allreduce", "ring", "adamw", "fp8", "full", "interleaved",
    "models:/m/1", "models:/m@champion", "http://127.0.0.1:1", "not-a-url", "1", "-1", "0",
    "a.b=1", "train.max_steps=-3", "model.name=nope",
]
INTS = ["-1", "0", "1", "2", "3", "8", "64", "-100000", "2147483648", "1000000000000", "abc", "1.5"]
FLOATS = ["-1", "-0.5", "0", "1e-300", "0.5", "1", "3", "1e300", "nan", "inf", "-inf", "abc"]


def _bad_number(text: str) -> bool:
    try:
        v = float(text)
    except ValueError:
        return False
    return v < 0 or not math.isfinite(v)


def value_strategy(kind: str, name: str = "") -> st.SearchStrategy[str]:
    if kind == "Path" and name in OUTPUT_PARAMS:
        return st.sampled_from(UNWRITABLE)
    if kind == "Path":
        return st.sampled_from(PATHS)
    if kind == "int":
        return st.one_of(st.sampled_from(INTS), st.integers(-(10**3), 10**4).map(str))
    if kind == "float":
        return st.one_of(
            st.sampled_from(FLOATS), st.floats(-1e6, 1e6, allow_nan=False).map(repr)
        )
    return st.one_of(st.sampled_from(WORDS), st.text(max_size=12))


@st.composite
def argv(draw: st.DrawFn, path: tuple[str, ...], cmd: Any) -> tuple[list[str], list[str]]:
    """The argument list and the numeric options given a negative or non-finite value."""
    args: list[str] = list(path)
    bad: list[str] = []
    for p in cmd.params:
        if p.param_type_name == "argument":
            n = 1 if p.nargs == 1 else draw(st.integers(0 if not p.required else 1, 3))
            if not p.required and not draw(st.booleans()):
                continue
            args += [draw(value_strategy(p.bare_type(), p.name)) for _ in range(n)]
            continue
        if p.name == "help" or not (p.required or draw(st.booleans())):
            continue
        if getattr(p, "is_flag", False):
            args.append(draw(st.sampled_from([*p.opts, *p.secondary_opts])))
            continue
        kind = p.bare_type()
        value = draw(value_strategy(kind, p.name))
        if kind in ("int", "float") and _bad_number(value) and (path[-1], p.name) not in SIGNED:
            bad.append(p.opts[0])
        args += [p.opts[0], value]
    return args, bad


def make_sandbox(root: Path) -> None:
    (root / "notes.txt").write_text("not a model, not a config\n")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (root / "bad.yaml").write_text("model: [1,\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "unknown.yaml").write_text("nonsense: 1\nmodel: {name: mlp, wings: 3}\n")
    (root / "emptydir").mkdir()


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@contextmanager
def hang_guard(what: str) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what} ran longer than {HANG_S} s: a hang on hostile input")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def check(args: list[str], bad_numbers: list[str], sandbox: Path) -> None:
    outside = sandbox.parents[3]  # tmp_path: relative paths climbing out (../../..) land here
    before, repo_before = tree(outside), set(os.listdir(REPO))
    with hang_guard(" ".join(args)):
        res = CliRunner().invoke(app, args, catch_exceptions=True)
    shown = f"hpcml {' '.join(args)}\nexit {res.exit_code}\n{res.output}"
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        f"{shown}\nescaped: {res.exception!r:.300}"
    )
    assert res.exit_code in (0, 1, 2), shown
    assert "Traceback" not in res.output, shown
    err_lines = [line for line in res.stderr.splitlines() if line.strip()]
    # One sentence, wrapped by the terminal width; click's usage errors take a boxed ~6 lines.
    assert len(err_lines) <= 8, shown
    if bad_numbers:
        assert res.exit_code == 2, f"{shown}\nnegative or non-finite: {bad_numbers}"
    assert set(os.listdir(REPO)) == repo_before, shown
    # Files may be created only inside the sandbox (the example's cwd); none outside.
    inside = str(sandbox.relative_to(outside))
    escaped = {p for p in tree(outside) - before if not p.startswith(inside)}
    assert not escaped, f"{shown}\ncreated outside the sandbox: {sorted(escaped)}"


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The examples' cwd, four folders below `tmp_path`: a relative path that climbs out of
    it (../../../x) stays inside `tmp_path`, where `check` sees it."""
    cwd = tmp_path / "a" / "b" / "c" / "d"
    cwd.mkdir(parents=True)
    make_sandbox(cwd)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(cwd))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{cwd / 'mlflow.db'}")
    monkeypatch.setenv("COLUMNS", "120")
    return cwd


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_verb_refuses_hostile_options_in_one_sentence(
    path: tuple[str, ...], cmd: Any, sandbox: Path
) -> None:
    @settings(max_examples=examples(12))
    @given(drawn=argv(path, cmd))
    def run(drawn: tuple[list[str], list[str]]) -> None:
        check(*drawn, sandbox)

    run()


# Defects found by hand (issue 19) and by the harness, kept as explicit regressions.
REGRESSIONS = [
    (["serve", "notes.txt"], []),
    (["data", "prepare", "pystdlib", "--out", "/proc/hpcml-fuzz/x"], []),
    (["plan", "memory", "--params", "-1", "--devices", "8"], ["--params"]),
    (["train", "blob.bin"], []),  # found by the harness: UnicodeDecodeError escaped
    (["train", "emptydir"], []),  # a folder where the config file is expected
    (["plan", "cost", "spot", "--on-demand-price", "-1"], ["--on-demand-price"]),
    (["loadtest", "not-a-url", "--model", "m", "--rate", "10", "--duration", "1"], []),
]


@pytest.mark.parametrize("args,bad", REGRESSIONS, ids=[" ".join(a) for a, _ in REGRESSIONS])
def test_found_defects_stay_fixed(args: list[str], bad: list[str], sandbox: Path) -> None:
    check(args, bad, sandbox)
