"""Runs a docs command that makes one folder, once per test session, for every page that has it.

`python docs_cache.py CACHE OUT -- COMMAND...` (what test_docs_commands.py writes for an
`hpcml data prepare ... --out OUT` or `hpcml train ... --run-dir OUT` line): the first page to
reach a command runs it in its own folder and stores OUT, its stdout, stderr and exit code in
CACHE under a key; a later page with the same key gets a copy of OUT and the same output,
instead of training or preparing again. The key is the command as written (OUT included, so a
run folder's recorded path stays true) and the contents of every file or folder the command
names that exists in the page's folder, the config's `data.path` among them (the corpus a run
reads): a page whose inputs differ runs the command itself.

CACHE is one folder per pytest session, shared by the xdist workers; a `filelock` per key makes
the second worker wait for the first, and an entry appears by one rename after all of it is
written, so no page ever copies a half-written folder. Only a command that exits 0 is stored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from filelock import FileLock

OUTSIDE = ("tracking.", "observe.")


def _digest(path: Path, h: hashlib._Hash) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())


def _inputs(argv: list[str], cwd: Path) -> list[Path]:
    """The paths in the page's folder that the command names, as an argument, an override's
    value, or the `data.path` of a YAML config it names."""
    named = [a.split("=", 1)[-1] for a in argv]
    for arg in argv:
        if arg.endswith((".yaml", ".yml")) and _exists(cwd, arg):
            config = yaml.safe_load((cwd / arg).read_text()) or {}
            data_path = (config.get("data") or {}).get("path")
            if isinstance(data_path, str):
                named.append(data_path)
    return [cwd / n for n in named if _exists(cwd, n)]


def _exists(cwd: Path, name: str) -> bool:
    """Whether `name` is a path in the page's folder (what a page makes or links there; an
    absolute path or one with `..`, which pages do not use, only counts as written)."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    try:
        return (cwd / name).exists()
    except (OSError, ValueError):  # an argument that is no path (too long, a NUL)
        return False


def _writes_only_out(argv: list[str], cwd: Path) -> bool:
    """False for a run that also writes elsewhere (an MLflow store, Prometheus targets) or
    continues or replaces what is in OUT."""
    if any(a in ("--resume", "--overwrite") or a.startswith(OUTSIDE) for a in argv):
        return False
    for arg in argv:
        if arg.endswith((".yaml", ".yml")) and _exists(cwd, arg):
            config = yaml.safe_load((cwd / arg).read_text()) or {}
            if any(section in config for section in ("tracking", "observe")):
                return False
    return True


def key(argv: list[str], out: str, cwd: Path) -> str:
    h = hashlib.sha256(json.dumps([argv, out]).encode())
    for path in _inputs(argv, cwd):
        h.update(str(path.relative_to(cwd)).encode() + b"\0")
        _digest(path, h)
    return h.hexdigest()[:32]


def _replay(entry: Path) -> int:
    sys.stdout.write((entry / "stdout").read_text())
    sys.stderr.write((entry / "stderr").read_text())
    return int((entry / "rc").read_text())


def run(cache: Path, out: str, argv: list[str], cwd: Path) -> int:
    if (cwd / out).exists() or not _writes_only_out(argv, cwd):
        return subprocess.run(argv, cwd=cwd).returncode
    cache.mkdir(parents=True, exist_ok=True)
    k = key(argv, out, cwd)
    entry = cache / k
    with FileLock(str(cache / f"{k}.lock")):
        if entry.is_dir():
            shutil.copytree(entry / "out", cwd / out, symlinks=True)
            return _replay(entry)
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        if proc.returncode == 0 and (cwd / out).exists():
            tmp = cache / f"{k}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(cwd / out, tmp / "out", symlinks=True)
            (tmp / "stdout").write_text(proc.stdout)
            (tmp / "stderr").write_text(proc.stderr)
            (tmp / "rc").write_text(str(proc.returncode))
            tmp.rename(entry)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


def main() -> int:
    cache, out, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: docs_cache.py CACHE OUT -- COMMAND..."
    return run(Path(cache), out, argv, Path.cwd())


if __name__ == "__main__":
    sys.exit(main())
