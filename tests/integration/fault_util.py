"""Shared pieces of the fault-tolerance tests: a tiny real training config, `hpcml train` in a
subprocess, waiting on files a run writes, and reading its step losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

SRC = Path(__file__).resolve().parents[2] / "src"


def env(**extra: str) -> dict[str, str]:
    # One thread per process: the runs compared bit for bit must sum in the same order, and
    # the CI machine has two cores.
    return {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def config_dict(**sections: dict[str, Any]) -> dict[str, Any]:
    """A small MLP on real data (scikit-learn digits), quick enough for many runs on 2 cores."""
    cfg: dict[str, Any] = {
        "model": {"name": "mlp", "args": {"hidden": 64}},
        "data": {"source": "digits", "batch_size": 16, "limit_train": 256},
        "optim": {"name": "adamw", "lr": 0.003, "warmup_steps": 5},
        "train": {
            "max_steps": 60,
            "eval_every": 0,
            "checkpoint_every": 10,
            "keep_last": 3,
            "log_every": 1,
            "seed": 0,
            "device": "cpu",
        },
        "parallel": {"timeout_s": 60},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def write_config(path: Path, **sections: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config_dict(**sections)))
    return path


def train_cmd(config: Path, run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "hpcml", "train", str(config), "--run-dir", str(run_dir),
        "--quiet", *args,
    ]


def run_train(
    config: Path, run_dir: Path, *args: str, timeout: float = 240, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    """`hpcml train` run to its end, forked from the pre-imported server (tests/conftest.py's
    hpcml_proc); past `timeout` it and its workers are killed and the test fails."""
    from tests.conftest import hpcml_proc

    try:
        return hpcml_proc(train_cmd(config, run_dir, *args)[3:], env=env(**env_extra),
                          timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"hpcml train did not end within {timeout} s:\n{exc.output}\n{exc.stderr}"
        ) from None


def start_train(config: Path, run_dir: Path, *args: str, **env_extra: str) -> subprocess.Popen[str]:
    """`hpcml train` in its own session, so that `finish` can end it with all its workers."""
    return subprocess.Popen(
        train_cmd(config, run_dir, *args),
        env=env(**env_extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """Wait for the run; past `timeout`, kill it and its torchrun agent and workers, then fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts the workers in sessions of their own: kill them by ancestry, or a
        # stuck one keeps the output pipe open and communicate() waits for it forever.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"hpcml train did not end within {timeout} s:\n{out}\n{err}") from None
    return out or "", err or ""


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 120, every: float = 0.05,
             proc: subprocess.Popen[str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process ended (rc {proc.returncode}) before {what}:\n{out}")
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def records(run_dir: Path, kind: str = "step") -> list[dict[str, Any]]:
    path = run_dir / "run.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("kind", "step") == kind:
            out.append(rec)
    return out


def step_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (a replay after rollback) keeps its last value."""
    return {int(r["step"]): r["loss"] for r in records(run_dir)}


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def pid_of(run_dir: Path, rank: int) -> int | None:
    path = run_dir / "pids" / f"rank-{rank}.pid"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# --- training in a forked child: many short runs without paying interpreter + torch start-up --

_CTX: Any = None


def engine_context() -> Any:
    """A forkserver that has imported the engine once; each run is a fork of it (a real,
    separate process that can be killed with -9), started in a fraction of a second."""
    global _CTX
    if _CTX is None:
        import multiprocessing as mp

        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["hpcml.train.engine"])
    return _CTX


def _engine_child(cfg: dict[str, Any], run_dir: str, resume: str | None,
                  env_extra: dict[str, str], results: Any) -> None:
    os.environ.update(env_extra)
    import torch

    from hpcml.config import build_config
    from hpcml.errors import HpcmlError
    from hpcml.train.engine import run

    torch.set_num_threads(1)
    try:
        out = run(build_config(cfg), run_dir=Path(run_dir), resume=resume, quiet=True)
        results.put(("ok", out.get("status")))
    except HpcmlError as exc:
        results.put((type(exc).__name__, exc.message))


def start_engine(cfg: dict[str, Any], run_dir: Path, resume: str | None = None,
                 **env_extra: str) -> tuple[Any, Any]:
    ctx = engine_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_engine_child, args=(cfg, str(run_dir), resume, env_extra, results))
    proc.start()
    return proc, results


def run_engine(cfg: dict[str, Any], run_dir: Path, resume: str | None = None,
               timeout: float = 180, **env_extra: str) -> tuple[str, Any]:
    """Run the engine to its end in a forked child; ("ok", status) or (error class, message)."""
    proc, results = start_engine(cfg, run_dir, resume, **env_extra)
    try:
        outcome = results.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return outcome
