"""The server watches its inputs: a live drift profile per model version, compared with the
export's reference profile (`reference_profile.json`, written by `hpcml train`) every
`drift.every_s` seconds.

Hot path cost: after a request is answered, the router hands its input array here; at most
`drift.sample_rows` rows of it are kept (by reference when the request has no more rows, else
copied; no statistics) in a bounded list of at most `drift.max_pending_rows` rows (rows
arriving while the list is full are dropped and counted). The histogram and reservoir updates,
the tests run in the periodic check, in a worker thread, off the event loop; a check folds at
most `drift.max_values_per_check` values per feature (an image row gives a share of its
pixels), which bounds its cost. The live profile is the last `drift.window_rows` rows
(`hpcml.data.drift_window`), so it forgets.

When a version first has a drifted feature (`hpcml.data.drift_compare.compare`: PSI over
`drift.psi_threshold` and a Bonferroni-corrected chi-square p-value under `drift.alpha`, with at
least `drift.min_samples` rows in the window), the crossing counter goes up and the operator's
`drift.command` (an argv list from the serve config, never from a model file) runs without a
shell, with HPCML_MODEL, HPCML_VERSION and HPCML_PSI in its environment, at most once per
`every_s` for each model; its exit status is logged and serving never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from hpcml.data.drift import REFERENCE_FILE, Profile, build_profile, load_profile
from hpcml.data.drift_compare import compare
from hpcml.data.drift_window import LiveWindow
from hpcml.errors import DataError
from hpcml.serve.config import DriftConfig
from hpcml.serve.metrics import ServeMetrics

log = logging.getLogger("hpcml.serve.traffic.drift")


def find_reference(path: Path) -> Path | None:
    """The reference profile beside model.json (an export folder, or a run folder's export/)."""
    for candidate in (path / REFERENCE_FILE, path / "export" / REFERENCE_FILE):
        if candidate.is_file():
            return candidate
    return None


@dataclass
class Watched:
    model: str
    version: str
    reference: Profile | None
    live: LiveWindow | None = None
    rows: int = 0
    dropped: int = 0
    pending: list[np.ndarray] = field(default_factory=list)
    pending_rows: int = 0
    over: bool = False
    checks: int = 0
    last: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards `pending` (the request path appends, the check drains)."""
    fold_lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards `live` (the periodic check and a profile download both fold pending rows)."""


class DriftMonitor:
    def __init__(self, config: DriftConfig, metrics: ServeMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.watched: dict[tuple[str, str], Watched] = {}
        self.commands_run = 0
        self._last_command: dict[str, float] = {}
        """Per model: a drift on one model never holds back another's command."""
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, model: str, version: str, path: Path) -> None:
        ref_path = find_reference(path)
        reference = None
        if ref_path is not None:
            try:
                reference = load_profile(ref_path)
            except DataError as exc:
                log.warning("drift: %s; %s:%s is watched without a reference", exc, model, version)
        if reference is not None and reference.note:
            log.warning("drift on %s:%s: %s", model, version, reference.note)
        self.watched[(model, version)] = Watched(model, version, reference)

    def observe(self, model: str, version: str, x: np.ndarray) -> None:
        """On the request path: keep a reference to a few rows, nothing else."""
        w = self.watched.get((model, version))
        if w is None or not self.config.enabled:
            return
        k = self.config.sample_rows
        # A copy when the request has more rows: a view would keep the whole request alive.
        rows = x[:k].copy() if len(x) > k else x
        with w.lock:
            if w.pending_rows + len(rows) > self.config.max_pending_rows:
                w.dropped += len(rows)
                return
            w.pending.append(rows)
            w.pending_rows += len(rows)

    def _drain(self, w: Watched) -> None:
        with w.lock:
            pending, w.pending, w.pending_rows = w.pending, [], 0
        if not pending:
            return
        x = np.concatenate(pending)
        per_row = max(1, self.config.max_values_per_check // len(x))
        with w.fold_lock:
            if w.live is None:  # no reference: bins from the first rows seen
                bins = w.reference if w.reference is not None else build_profile(x, seed=1)
                w.live = LiveWindow(bins, self.config.window_rows, seed=1)
            w.live.add(x, per_row)
            w.rows += len(x)

    def check(self, w: Watched) -> dict[str, Any] | None:
        """Fold pending rows into the live profile and compare it with the reference."""
        self._drain(w)
        if w.reference is None or w.live is None or w.live.filled < self.config.min_samples:
            return None
        with w.fold_lock:
            live = w.live.profile()
        # No KS here: it is reported only, and it was most of a check's cost.
        result = compare(
            w.reference, live, self.config.psi_threshold, alpha=self.config.alpha, ks=False
        )
        result.update(model=w.model, version=w.version, rows=w.rows, dropped_rows=w.dropped)
        w.last = result
        return result

    async def check_all(self) -> None:
        for w in list(self.watched.values()):
            result = await asyncio.to_thread(self.check, w)
            if result is None:
                continue
            w.checks += 1
            for row in result["features"]:
                if row["psi"] is not None:
                    gauge = self.metrics.drift_psi.labels(w.model, w.version, row["feature"])
                    gauge.set(row["psi"])
            over = bool(result["drifted"])
            if over and not w.over:
                self.metrics.drift_crossings.labels(w.model, w.version).inc()
                self._run_command(w, result["max_psi"])
            w.over = over

    def _run_command(self, w: Watched, value: float) -> None:
        now = time.monotonic()
        last = self._last_command.get(w.model, float("-inf"))
        if not self.config.command or now - last < self.config.every_s:
            return
        self._last_command[w.model] = now
        env = {
            **os.environ,
            "HPCML_MODEL": w.model,
            "HPCML_VERSION": w.version,
            "HPCML_PSI": f"{value:.6g}",
        }
        task = asyncio.create_task(self._command(list(self.config.command), env, w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _command(self, argv: list[str], env: dict[str, str], w: Watched) -> None:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            self.commands_run += 1
            code = await proc.wait()
        except OSError as exc:
            log.error("drift command %s for %s:%s did not start: %s", argv, w.model, w.version, exc)
            return
        log.warning("drift command %s for %s:%s exited %s", argv[0], w.model, w.version, code)

    def live_profile(self, w: Watched) -> dict[str, Any] | None:
        """The live profile as JSON (what `hpcml data drift` reads), pending rows included."""
        self._drain(w)
        with w.fold_lock:
            return w.live.profile().to_json() if w.live is not None else None

    async def run(self) -> None:
        """The periodic check (a router background task)."""
        while True:
            await asyncio.sleep(self.config.every_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the watch must never stop serving
                log.exception("drift check failed")

    async def close(self) -> None:
        """Stop waiting for commands still running (they go on; shutdown never waits)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def describe(self, model: str, version: str | None) -> dict[str, Any] | None:
        for (m, v), w in self.watched.items():
            if m == model and (version is None or v == version):
                return {
                    "model": m,
                    "version": v,
                    "reference": w.reference is not None,
                    "rows": w.rows,
                    "pending_rows": w.pending_rows,
                    "dropped_rows": w.dropped,
                    "psi_threshold": self.config.psi_threshold,
                    "alpha": self.config.alpha,
                    "window_rows": self.config.window_rows,
                    "over_threshold": w.over,
                    "checks": w.checks,
                    "comparison": w.last,
                }
        return None


def add_drift_routes(app: FastAPI, monitor: DriftMonitor) -> None:
    @app.get("/v2/models/{name}/drift", tags=["drift"])
    async def drift(
        name: str, version: str | None = None, profile: bool = Query(False)
    ) -> Response:
        state = monitor.describe(name, version)
        if state is None:
            return JSONResponse({"error": f"model '{name}' is not watched here."}, 404)
        w = monitor.watched[(state["model"], state["version"])]
        if profile:
            doc = await asyncio.to_thread(monitor.live_profile, w)
            if doc is None:
                return JSONResponse({"error": "no inputs seen yet; send requests first."}, 404)
            return JSONResponse(doc)
        return JSONResponse(state)
