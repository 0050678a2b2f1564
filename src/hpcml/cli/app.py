"""The `hpcml` typer application. Each verb group lives in its own module and is added here."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from hpcml.cli import audit as audit_cli
from hpcml.cli import data as data_cli
from hpcml.cli import launch as launch_cli
from hpcml.cli import launch_k8s as launch_k8s_cli
from hpcml.cli import model as model_cli
from hpcml.cli import observe as observe_cli
from hpcml.cli import plan as plan_cli
from hpcml.cli import profile as profile_cli
from hpcml.cli import promote as promote_cli
from hpcml.cli import registry as registry_cli
from hpcml.cli import report as report_cli
from hpcml.cli import serve as serve_cli
from hpcml.cli import sign as sign_cli
from hpcml.cli import train as train_cli
from hpcml.cli import tune as tune_cli
from hpcml.cli.common import fail
from hpcml.errors import HpcmlError

# Numeric options that may be negative (none today): every other int or float option is
# refused when negative, NaN or infinite, before the verb runs.
SIGNED_OPTIONS: frozenset[tuple[str, str]] = frozenset()
# OSErrors that mean the path given is wrong (exit 2); other ones are failures of the work (1).
_PATH_ERRNOS = {
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.EROFS,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}


def _finite_non_negative(ctx: typer.Context, param: Any, value: Any) -> Any:
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if number and (not math.isfinite(v) or v < 0):
            raise typer.BadParameter(f"{v!r} is not allowed: give a finite number >= 0.")
    return value


def _guard_numbers(cmd: Any) -> None:
    """Install the non-negative, finite check on every numeric parameter of the tree."""
    for sub in getattr(cmd, "commands", {}).values():
        _guard_numbers(sub)
    for p in getattr(cmd, "params", []):
        if _is_number(p) and p.callback is None and (cmd.name, p.name) not in SIGNED_OPTIONS:
            p.callback = _finite_non_negative


def _is_number(param: Any) -> bool:
    """An int or float parameter, in every typer the project admits: typer 0.2x describes a
    parameter's annotation (`bare_type`, `type_descriptor`); older ones, and click, a
    ParamType named integer or float."""
    if hasattr(param, "bare_type"):
        return bool(param.bare_type() in ("int", "float"))
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        return descriptor.annotation in (int, float)
    name = getattr(getattr(param, "type", None), "name", "")
    return name in ("integer", "float", "integer range", "float range")


class HpcmlGroup(TyperGroup):
    """Turns the errors a user can cause into one sentence and an exit code, for every verb,
    whether run as `hpcml` or in-process (typer's CliRunner, the fuzz harness)."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        _guard_numbers(self)
        return super().main(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except HpcmlError as exc:
            if os.environ.get("RANK", "0") != "0":  # every rank sees the same error
                raise SystemExit(exc.exit_code) from None
            fail(exc.message, exc.exit_code)
        except OSError as exc:
            if exc.filename is None:
                raise
            where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
            if exc.errno in _PATH_ERRNOS:
                # A path the user named that cannot be read or written (missing, a file where
                # a folder is expected, no permission): the input is what is wrong.
                fail(f"{where}: {exc.strerror or exc}; check the path and its permissions.", 2)
            # Anything else (a full disk, an I/O error) is a failure of the work.
            fail(f"{where}: {exc.strerror or exc}; the work stopped there.", 1)
        return None


app = typer.Typer(
    name="hpcml",
    cls=HpcmlGroup,
    help="Plan, feed, train, track, serve, watch and launch ML workloads on HPC hardware.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command(
    "train",
    context_settings={"allow_extra_args": False},
    help="Train a model from a YAML config on one process or N (DDP, ZeRO/FSDP, TP).",
)(train_cli.train)
app.add_typer(model_cli.app, name="model")
app.add_typer(data_cli.app, name="data")
app.add_typer(plan_cli.app, name="plan")
app.add_typer(registry_cli.app, name="registry")
launch_k8s_cli.register(launch_cli.app)
app.add_typer(launch_cli.app, name="launch")
app.add_typer(observe_cli.app, name="observe")
app.add_typer(audit_cli.app, name="audit")
sign_cli.register(serve_cli.export_app)
serve_cli.register(app)
app.command("report", help=report_cli.report.__doc__)(report_cli.report)
app.command("profile", help=profile_cli.profile.__doc__)(profile_cli.profile)
app.command("tune", help=tune_cli.tune.__doc__)(tune_cli.tune)
app.command("promote", help=promote_cli.promote.__doc__)(promote_cli.promote)


def main() -> None:
    """The command line; ends with SystemExit (in-process callers, the tests' CliRunner)."""
    try:
        app()
    except KeyboardInterrupt:
        fail("interrupted.", 130)


def run() -> None:
    """`hpcml` and `python -m hpcml`: `main`, then the process ends through `exit_now`."""
    code: int | str | None = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    forked = sys.modules.get("hpcml.launch.forked_workers")
    if forked is not None and forked.in_forked_worker():
        # A worker forked by torchrun's agent: torchrun's own code ends the process and hands
        # the agent its exit code (hpcml.launch.forked_workers).
        raise SystemExit(wind_down(code))
    exit_now(code)


def wind_down(code: int | str | None) -> int:
    """What the interpreter does before it exits: wait for non-daemon threads, run the atexit
    handlers, flush stdout and stderr; the exit code (sys.exit("text") prints it, code 1)."""
    import atexit
    import threading

    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # The interpreter's own first step of shutting down: the threading module's exit hooks
    # (concurrent.futures tells its pools' workers to stop) and then the join of non-daemon
    # threads. Joining them without the hooks waits forever on an executor's idle workers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code or 0


def exit_now(code: int | str | None) -> None:
    """End the process as the interpreter would (`wind_down`), without tearing down every
    imported module first: with torch, torch.distributed and the trainer loaded that teardown
    costs ~1 CPU s per process, paid by every worker of every run (run files are written
    line-buffered or closed before this; nothing left to flush lives in a module's globals)."""
    os._exit(wind_down(code))


if __name__ == "__main__":
    run()
