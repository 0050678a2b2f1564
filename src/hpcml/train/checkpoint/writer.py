"""The background checkpoint writer's thread, below the training threads' priority.

A background save (train.checkpoint_async) serializes, hashes (sha256) and fsyncs from a thread
of the training process. Where training already keeps every core busy (a CPU run), that thread
takes cycles from the training threads at the same priority, and a checkpoint can add as much
time to the run as a synchronous one (benchmarks/checkpoint_stall.py). Linux gives each thread
its own nice value (setpriority on the thread's id): the writer raises its own by
`train.checkpoint_writer_nice` as its save begins, so the scheduler runs it on what training
leaves. Elsewhere setpriority applies to the whole process, so nothing is changed there.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from hpcml.distributed import dcp_safe

MAX_NICE = 19  # the lowest priority Linux has


def lower_this_thread(increment: int) -> int | None:
    """Raise the calling thread's nice value by `increment` (capped at 19, never lowered) and
    return the value it now has; None where that is not possible (not Linux, or refused)."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        target = min(MAX_NICE, now + increment)
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # a sandbox without setpriority: the write goes on at training's priority
        return None
    return target


def this_thread_nice() -> int | None:
    """The calling thread's nice value (None where threads have none of their own)."""
    if not sys.platform.startswith("linux"):
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class NiceFileSystemWriter(dcp.FileSystemWriter):
    """DCP's file writer that lowers the priority of the thread that writes with it: async_save
    calls `set_up_storage_writer` first thing in its writer thread, and the hashing, fsync and
    rename hpcml chains after the write run in that same thread."""

    def __init__(self, path: str, nice: int) -> None:
        super().__init__(path)
        self.nice = nice

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        lower_this_thread(self.nice)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def async_save(
    state: dict[str, Any], path: str, process_group: Any, nice: int, key: Any = None
) -> Future[Any]:
    """dcp.async_save of `state` into `path`, written by a thread whose nice value is raised by
    `nice`; returns the future of the write. The state is copied to host memory before this
    returns (DCP's default staging, blocking), so training may change its tensors at once."""
    # Given explicitly: a FileSystemWriter would otherwise stage the state itself.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        response = dcp.async_save(
            state,
            checkpoint_id=path,
            storage_writer=NiceFileSystemWriter(path, nice)
            if key is None
            else dcp_safe.sealed_writer(path, key, NiceFileSystemWriter(path, nice)),
            async_stager=stager,
            process_group=process_group,
        )
    except BaseException:
        stager.close()
        raise
    # Newer torch returns an AsyncSaveResponse (staging + upload futures), older a Future.
    upload: Future[Any] = getattr(response, "upload_completion", response)  # type: ignore[arg-type]
    upload.add_done_callback(lambda _: stager.close())  # a caller-made stager is ours to close
    return upload
