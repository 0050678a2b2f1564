"""Shared test helpers: run the real `hpcml` command in a subprocess and read run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import forked

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def in_ci() -> bool:
    """CI=true (what `.ci/run` sets; 1 and yes too): a test whose system tool is missing fails."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def system_binary(*names: str, installer: str) -> str:
    """The path of a program a Debian package provides (the first of `names` found). Missing:
    the test fails under CI=true (`.ci/run` runs every `.ci/install_*.sh` first), else it skips
    saying how to install it. tests/unit/test_ci_installers.py checks that `installer` exists
    and names the program."""
    import shutil

    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    if in_ci():
        pytest.fail(f"{names[0]} is missing in CI; {installer} should install it.", pytrace=False)
    pytest.skip(f"{names[0]} is not installed (bash {installer} installs it)")


def hpcml_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def hpcml_proc(
    args: list[str],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([sys.executable, "-m", "hpcml", *args], capture_output=True, text=True)`:
    the command in a process of its own, run to its end. Forked from a server that has imported
    torch and hpcml (tests/forked.py: the same command line without paying the imports again)
    unless `fresh` or HPCML_TEST_FORK=0: then a new interpreter."""
    if forked.ENABLED and not fresh:
        return forked.run(list(args), cwd or ROOT, env or hpcml_env(), timeout)
    return subprocess.run(
        [sys.executable, "-m", "hpcml", *args],
        cwd=cwd or ROOT,
        env=env or hpcml_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_hpcml(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    check: bool = True,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`hpcml_proc`, failing the test with the command's output when `check` and it fails."""
    proc = hpcml_proc(list(args), cwd, env, timeout, fresh)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"hpcml {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def step_losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run_dir / "run.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            out[int(rec["step"])] = rec["loss"]
    return out


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def session_shared_dir(factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every xdist worker of this pytest session shares (their base folders' parent,
    new each session: a later session, perhaps with other code, never reads it)."""
    base = factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session", autouse=True)
def _hpcml_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shard hash cache (`hpcml.data.shards.hash_cache`, else ~/.cache/hpcml) goes to this
    session's temporary folder, for this process and the `hpcml` processes tests start: a test
    writes nothing outside its temporary folders."""
    cache = tmp_path_factory.mktemp("hpcml-cache")
    # The traced steps (hpcml.train.trace_cache: a file per config, written whole by a rename)
    # in one folder of this session's that every xdist worker shares, as one user's runs do:
    # each worker tracing the same configs again cost the suite a cold trace per config each.
    shared = session_shared_dir(tmp_path_factory, "plan-traces")
    shared.mkdir(exist_ok=True)
    (cache / "plan_traces").symlink_to(shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPCML_CACHE_DIR", str(cache))
        yield


@pytest.fixture
def tiny_args() -> list[str]:
    """Overrides that make a digits run take a few seconds."""
    return [
        "data.batch_size=16",
        "train.eval_every=0",
        "train.log_every=2",
        "train.deterministic=true",
    ]


# --- CPU seconds per test (HPCML_TEST_CPU=FILE): what each test costs a 2-core machine ---------
# Wall time on a shared machine says how busy the machine was; CPU time (this process and every
# child it waited for, user + system) says what the test itself costs, contended or not. One
# JSON line per test: {"nodeid", "cpu_s", "wall_s"}. `python tests/cpu_report.py FILE` sums them
# per file. Off unless the variable is set.
_CPU_REPORT = os.environ.get("HPCML_TEST_CPU")


def _cpu_now() -> float:
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + forked.forked_cpu_s


if _CPU_REPORT:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
        import time

        cpu0, wall0 = _cpu_now(), time.monotonic()
        yield
        rec = {
            "nodeid": item.nodeid,
            "cpu_s": round(_cpu_now() - cpu0, 3),
            "wall_s": round(time.monotonic() - wall0, 3),
        }
        with open(_CPU_REPORT, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


# --- Scheduling over xdist workers (`-n 3 --dist loadfile --no-loadscope-reorder`, what
# `make test` passes) -----------------------------------------------------------------------------
# Each test file is one unit of work (one worker runs all of it, so its module fixtures are built
# once), except the docs pages: each page is a unit of its own, since they are the suite's longest
# tests and one unit would run them all on one worker, one after another. Units start costliest
# first, by the wall seconds in tests/cost.json (`tests/cpu_report.py --write`), so the workers end
# together instead of one running a long file alone at the end; a unit the file does not know
# starts after the known ones, in collection order. (xdist's own `loadgroup` would do the
# grouping, but with pytest 9.2 its renamed node ids do not reach the scheduler.)
_COST_FILE = ROOT / "tests" / "cost.json"
_OWN_UNITS = ("tests/integration/test_docs_commands.py::test_the_page_commands_run_as_written[",)


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its file, or the test itself for the docs pages."""
    return nodeid if nodeid.startswith(_OWN_UNITS) else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CostFirstFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return CostFirstFiles(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # only the order the workers report reaches the scheduler
    cost: dict[str, float] = json.loads(_COST_FILE.read_text()) if _COST_FILE.exists() else {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(unit_of(item.nodeid), i)
    items.sort(key=lambda it: (-cost.get(unit_of(it.nodeid), 0.0), first[unit_of(it.nodeid)]))
