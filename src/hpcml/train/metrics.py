"""Step metrics: per-step records buffered on the device and flushed every `log_every` steps
(one host sync and one collective per flush, not per step), and the rank-0 live view."""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from hpcml.distributed.runtime import Runtime, all_reduce_mean
from hpcml.records import RunLog
from hpcml.train.mfu import Workload


class StepMeter:
    def __init__(
        self, rt: Runtime, global_batch: int, log: RunLog | None, view: LiveView | None
    ) -> None:
        self.rt = rt
        self.global_batch = global_batch
        self.log = log
        self.view = view
        self._pending: list[dict[str, Any]] = []
        self._losses: list[torch.Tensor] = []
        self.step_times: list[float] = []
        self.data_waits: list[float] = []
        self.last_loss: float | None = None
        self.flags: list[float] = []
        self.extra_sinks: list[Any] = []
        self.workload: Workload | None = None
        """When set, records also carry tokens/s and MFU."""

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        lr: float,
        step_time_s: float,
        data_wait_s: float,
        grad_norm: torch.Tensor | None = None,
        skipped: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        """`grad_norm` and `skipped` (1.0: the update was dropped) stay on the device until the
        flush, like the loss; without them (fp16 loss scaling) the record has neither."""
        nan = loss.new_full((), float("nan"))
        self._losses.append(
            torch.stack(
                [
                    loss.detach().float().reshape(()),
                    (nan if grad_norm is None else grad_norm).float().reshape(()).to(nan.device),
                    (nan if skipped is None else skipped).float().reshape(()).to(nan.device),
                ]
            )
        )
        sps = self.global_batch / step_time_s if step_time_s > 0 else None
        self._pending.append(
            {
                "kind": "step",
                "step": step,
                "lr": lr,
                "step_time_s": step_time_s,
                "data_wait_s": data_wait_s,
                "samples_per_s": sps,
                **(self.workload.rates(sps) if self.workload else {}),
                "time": time.time(),
                **extra,
            }
        )
        self.step_times.append(step_time_s)
        self.data_waits.append(data_wait_s)

    def flush(self, flags: list[float] | None = None) -> list[dict[str, Any]]:
        """Every rank must call this at the same steps (it reduces the losses across ranks).
        `flags` ride along in the same collective; their means are in `self.flags` after."""
        flags = flags or []
        if not self._pending and not flags:
            self.flags = []
            return []
        dev = self.rt.device
        # Per step: loss, global gradient norm, skipped; the latter two are alike on every rank.
        parts = [torch.cat(self._losses)] if self._losses else []
        parts += [torch.tensor(flags, dtype=torch.float32, device=dev)] if flags else []
        reduced = all_reduce_mean(self.rt, torch.cat(parts)).tolist()
        n = 3 * len(self._losses)
        values, self.flags = reduced[:n], reduced[n:]
        if not self._pending:
            return []
        for i, rec in enumerate(self._pending):
            loss, norm, skipped = values[3 * i : 3 * i + 3]
            rec["loss"] = loss
            if not math.isnan(skipped):
                rec["grad_norm"], rec["skipped"] = norm, skipped > 0.5
        out = self._pending
        self._pending, self._losses = [], []
        self.last_loss = out[-1]["loss"]
        if self.rt.is_main:
            if self.log is not None:
                self.log.write_many(out)
            if self.view is not None:
                self.view.update(out[-1])
            for sink in self.extra_sinks:
                sink(out)
        return out

    def throughput(self, skip: int = 3) -> dict[str, float | None]:
        """Median step time after the first `skip` (warm-up) steps, and samples/s from it."""
        times = self.step_times[skip:] if len(self.step_times) > skip else self.step_times
        if not times:
            return {"samples_per_s": None, "step_time_s": None, "data_wait_s": None}
        med = statistics.median(times)
        waits = self.data_waits[skip:] if len(self.data_waits) > skip else self.data_waits
        return {
            "samples_per_s": self.global_batch / med,
            "samples_per_s_per_device": self.global_batch / med / self.rt.world_size,
            **(self.workload.rates(self.global_batch / med) if self.workload else {}),
            "step_time_s": med,
            "data_wait_s": statistics.median(waits),
            "steps_measured": len(times),
        }


class LiveView:
    """Rank 0's progress bar (loss, samples/s, ETA), or plain log lines with `quiet`."""

    def __init__(self, total: int, start: int, quiet: bool) -> None:
        self.quiet = quiet or not sys.stderr.isatty()
        self.total = total
        self.console = Console(stderr=True)
        self._last_line = 0.0
        self.progress: Progress | None = None
        if not self.quiet:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[sps]} samples/s"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total, completed=start, loss="-", sps="-"
            )
            self.progress.start()

    def update(self, rec: dict[str, Any]) -> None:
        sps = rec.get("samples_per_s")
        if self.progress is not None:
            self.progress.update(
                self.task,
                completed=rec["step"],
                loss=f"{rec['loss']:.4f}",
                sps=f"{sps:,.0f}" if sps else "-",
            )
            return
        now = time.monotonic()
        if now - self._last_line >= 5.0 or rec["step"] >= self.total:
            self._last_line = now
            self.console.print(
                f"step {rec['step']}/{self.total}  loss {rec['loss']:.4f}  lr {rec['lr']:.3g}  "
                f"{sps or 0:,.0f} samples/s",
                highlight=False,
            )

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
