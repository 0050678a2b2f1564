"""What a rank's pipeline stages compute under a schedule (`parallel.pp`), and in which order.

`StageClock` wraps each stage's per-chunk methods, which every schedule of
`torch.distributed.pipelining` calls (torch 2.13: `forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`), and the loss the last stage computes after its forward. Per call
it records:
- the wall seconds (`busy_s`): the rest of a schedule's step is waiting for the neighbours and
  for the operating system, the bubble a run's wall clock measures;
- the action (stage, kind, micro-batch) in the order this rank ran it, and its CPU seconds (this
  thread's, `time.thread_time`): what the computation cost whatever else the machine ran.

`replayed()` gives the actions' order of the last recorded step and, for each, the median CPU
seconds of its stage's actions of that kind (every micro-batch of every recorded step: one
action's few samples vary by 20% on a loaded machine, a stage's cost per kind much less), for
`hpcml.plan.bubble.replay`: the bubble of the schedule as it ran, without waits, insensitive to
the machine's load (the share is a ratio of CPU times).

Host times: on a GPU a chunk's wall and CPU time are mostly its kernel launches, so both
bubbles describe the host there, not the device.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

Action = tuple[int, str, int]
"""(stage index, kind, micro-batch): see hpcml.plan.bubble.Action."""


class StageClock:
    """The clock of one rank's stages (the module docstring says what it records)."""

    METHODS = {
        "forward_one_chunk": "F",
        "backward_one_chunk": "B",
        "backward_weight_one_chunk": "W",
    }
    KEEP = 4096
    """CPU costs kept per stage and kind (the newest; for the median)."""

    def __init__(self, stages: Sequence[Any]) -> None:
        self.busy_s = 0.0
        self._recording = False
        self._order: list[Action] = []
        self.order: list[Action] = []
        """The actions of the last recorded step, in the order this rank ran them."""
        self._cpu: dict[tuple[int, str], deque[float]] = {}
        self._last_forward: Action | None = None
        for stage in stages:
            for name, kind in self.METHODS.items():
                method = getattr(stage, name)
                setattr(stage, name, self._timed(method, stage.stage_index, kind))

    def _timed(self, method: Callable[..., Any], stage: int, kind: str) -> Callable[..., Any]:
        def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
            action = (stage, kind, chunk)
            if kind == "F":
                self._last_forward = action
            with self._measure(action):
                return method(chunk, *args, **kwargs)

        return timed

    def timed_loss(self, loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`loss_fn` timed as the last stage's action "L" of the micro-batch it just forwarded
        (every schedule computes the loss right after that forward)."""

        def timed(output: Any, target: Any) -> Any:
            stage, _, chunk = self._last_forward or (-1, "F", -1)
            with self._measure((stage, "L", chunk)):
                return loss_fn(output, target)

        return timed

    @contextmanager
    def _measure(self, action: Action) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - t0
            if self._recording:
                cpu = time.thread_time() - c0
                self._order.append(action)
                self._cpu.setdefault(action[:2], deque(maxlen=self.KEEP)).append(cpu)

    @contextmanager
    def step(self, record: bool) -> Iterator[None]:
        """One schedule step; with `record`, its actions and CPU costs are kept."""
        self._recording, self._order = record, []
        try:
            yield
        finally:
            if record:
                self.order = self._order
            self._recording = False

    def replayed(self) -> dict[str, Any]:
        """{"order": the last recorded step's actions, "cpu_s": the median CPU seconds of
        each one's stage and kind}; both empty before a step was recorded."""
        cpu = {k: statistics.median(v) for k, v in self._cpu.items()}
        return {"order": list(self.order), "cpu_s": [cpu[a[:2]] for a in self.order]}
