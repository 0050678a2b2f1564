"""The docs test's shared runs (tests/integration/docs_cache.py): a command runs once for pages
that have it alike, even at the same moment from two workers, every page gets the whole folder
and output, and a page whose inputs differ, or a command that failed, is never served a copy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

CACHE_PY = ROOT / "tests" / "integration" / "docs_cache.py"
# Makes OUT/made.txt from the config it names (after a pause, so two pages overlap), counts its
# runs in a file outside both pages, prints a line and exits with the code it is given (both
# through the environment, which is not part of what the cache compares).
MAKER = """
import os, sys, time
from pathlib import Path
config, out = sys.argv[1:]
count, rc = os.environ["MAKER_COUNT"], os.environ["MAKER_RC"]
with open(count, "a") as f:
    f.write("run\\n")
time.sleep(1.0)
Path(out).mkdir(parents=True)
Path(out, "made.txt").write_text(Path(config).read_text() * 1000)
print("made", out)
sys.exit(int(rc))
"""


def _page(tmp_path: Path, name: str, config: str) -> Path:
    page = tmp_path / name
    page.mkdir()
    (page / "conf.yaml").write_text(config)
    return page


def _start(cache: Path, page: Path, count: Path, rc: int = 0) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", MAKER, "conf.yaml", "runs/a"]
    return subprocess.Popen(
        [sys.executable, str(CACHE_PY), str(cache), "runs/a", "--", *cmd],
        cwd=page,
        env={**os.environ, "MAKER_COUNT": str(count), "MAKER_RC": str(rc)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _runs(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def test_two_pages_at_once_run_it_once_and_both_get_the_whole_folder(tmp_path: Path) -> None:
    cache, count = tmp_path / "cache", tmp_path / "count"
    pages = [_page(tmp_path, n, "data: {x: 1}\n") for n in ("p1", "p2")]
    procs = [_start(cache, page, count) for page in pages]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert _runs(count) == 1
    assert [o[0] for o in outs] == ["made runs/a\n"] * 2
    for page in pages:
        assert (page / "runs/a/made.txt").read_text() == "data: {x: 1}\n" * 1000


def test_a_page_whose_inputs_differ_runs_the_command_itself(tmp_path: Path) -> None:
    cache, count = tmp_path / "cache", tmp_path / "count"
    first = _page(tmp_path, "p1", "data: {x: 1}\n")
    other = _page(tmp_path, "p2", "data: {x: 2}\n")
    for page in (first, other):
        assert _start(cache, page, count).wait(timeout=60) == 0
    assert _runs(count) == 2
    assert (other / "runs/a/made.txt").read_text() == "data: {x: 2}\n" * 1000


def test_a_command_that_failed_is_not_served_to_the_next_page(tmp_path: Path) -> None:
    cache, count = tmp_path / "cache", tmp_path / "count"
    first = _page(tmp_path, "p1", "data: {x: 1}\n")
    assert _start(cache, first, count, rc=3).wait(timeout=60) == 3
    second = _page(tmp_path, "p2", "data: {x: 1}\n")
    assert _start(cache, second, count, rc=0).wait(timeout=60) == 0
    assert _runs(count) == 2
