"""Errors a user can cause. Each carries one sentence: what was wrong, where, and what to do.

The CLI prints the sentence and exits with `exit_code`; no traceback is shown for these.
"""

from __future__ import annotations


class HpcmlError(Exception):
    """Base of every user-facing error. `exit_code` 2 means bad input, 1 a failure of the work."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(HpcmlError):
    """A config file, key or value that cannot be used."""


class DataError(HpcmlError):
    """A data source that is missing, unreadable or malformed."""


class CheckpointError(HpcmlError):
    """A checkpoint that is missing, partial or corrupt."""


class RunDirError(HpcmlError):
    """A run folder that would be overwritten or cannot be used."""


class LaunchError(HpcmlError):
    """A launch request the machine cannot satisfy (too many processes, missing tool)."""


class ModelError(HpcmlError):
    """An unknown model name or a user model that cannot be imported or built."""


class WorkFailed(HpcmlError):
    """The work itself failed (not the input); exit code 1."""

    exit_code = 1


class Interrupted(HpcmlError):
    """Stopped by Ctrl-C (SIGINT) without a checkpoint for it; 130 like a shell's 128 + SIGINT."""

    exit_code = 130


REQUEUE_EXIT_CODE = 75
"""EX_TEMPFAIL from sysexits.h ("try again later"): the run saved a checkpoint and stopped on
request (SIGTERM/SIGUSR1); a scheduler should requeue it and `--resume auto` continues it.
Distinct from 143/138 (killed by the signal before anything was saved) and from 1 and 2."""


class Preempted(HpcmlError):
    """Training stopped on a preemption signal after saving a checkpoint; requeue to continue."""

    exit_code = REQUEUE_EXIT_CODE

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        """The checkpoint saved for this preemption (summary.json names it)."""
