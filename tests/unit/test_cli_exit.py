"""`hpcml` ends without tearing down its modules (hpcml.cli.app.exit_now) but otherwise as the
interpreter would: idle thread-pool workers are told to stop (joining them without that hangs
for ever: the S3 readahead pool did), non-daemon threads are waited for, atexit handlers run,
buffered output is flushed, and the exit code is kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from hpcml.cli.app import exit_now
pool = ThreadPoolExecutor(2, thread_name_prefix="idle")
pool.submit(time.sleep, 0.01).result()  # a worker now waits for work, not a daemon
done = []
threading.Thread(target=lambda: (time.sleep(0.3), done.append(1))).start()
atexit.register(lambda: print("atexit saw the thread end:", bool(done)))
sys.stdout.write("buffered, no newline")
exit_now(CODE)
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM.replace("CODE", code)],
        env={"PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=60,  # the bug this guards against hangs for ever
    )


def test_exit_now_stops_idle_pools_waits_for_threads_runs_atexit_and_flushes() -> None:
    proc = _run("3")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newlineatexit saw the thread end: True\n", proc.stdout


def test_a_text_exit_is_printed_and_exits_1() -> None:
    proc = _run("'no such thing'")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("no such thing"), proc.stderr
