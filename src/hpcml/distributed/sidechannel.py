"""Side channels beside the training process group, for fault tolerance.

- `checkpoint_group`: a gloo group of its own for background checkpoint writes, so the
  collectives DCP runs in its writer thread never interleave with the training loop's
  collectives on the default group (two threads on one group can deadlock).
- `HeartBoard`: every rank posts its progress to the rendezvous key-value store (TCPStore),
  which keeps answering while the training collectives are stuck, so a watchdog can name the
  rank that stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hpcml.distributed.runtime import Runtime

_ckpt_group: tuple[Any, Any] | None = None  # (default group it belongs to, the gloo group)


def checkpoint_group(rt: Runtime) -> Any:
    """The gloo group for background checkpoint writes (None in a single process).

    Every rank must call this at the same point the first time (it creates a group).
    """
    global _ckpt_group
    if not rt.distributed or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _ckpt_group is None or _ckpt_group[0] is not world:
        _ckpt_group = (world, dist.new_group(backend="gloo"))
    return _ckpt_group[1]


class HeartBoard:
    """Per-rank progress in the rendezvous store; a local dict when there is no store."""

    def __init__(self, rt: Runtime, timeout_s: float = 10.0) -> None:
        self.rank = rt.rank
        self.world_size = rt.world_size
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Keys survive an elastic restart in the agent's store: name them per attempt.
        self.prefix = f"hpcml/heartbeat/{run_id}/{attempt}/"
        self._local: dict[int, dict[str, Any]] = {}
        self.store: Any = None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if rt.distributed and addr and port:
            try:
                self.store = dist.TCPStore(
                    addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)
                )
            except Exception:  # noqa: BLE001 - the board is a diagnostic aid, never a failure
                self.store = None

    def post(self, payload: dict[str, Any]) -> None:
        self._local[self.rank] = payload
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(self.prefix + str(self.rank), json.dumps(payload))

    def read_all(self) -> dict[int, dict[str, Any] | None]:
        """Latest payload of every rank (None for a rank that never posted)."""
        if self.store is None:
            return {r: self._local.get(r) for r in range(self.world_size)}
        out: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world_size):
            key = self.prefix + str(r)
            try:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out
