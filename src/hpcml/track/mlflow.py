"""The training run's MLflow tracker: one MLflow run per run folder, talked to by rank 0 only.

The engine calls `start`, `log_steps`, `log_eval` and `finish`. Step metrics are reduced over
windows of `tracking.log_every` steps, queued, and sent at most every `tracking.flush_every_s`
with MLflow's asynchronous `log_batch`: the loop never waits on the store, and the store's
background thread (about 10 ms per write on SQLite) rarely competes with it.
`run_dir/tracking.json` remembers the MLflow store and run, so a resumed training run continues
the same MLflow run from whatever working folder it is resumed in; a resume told to track in
another store is refused before anything is written. Tracking failures after `start` are
warned about, never raised: an unreachable store must not kill a training run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcml.config import TrackingConfig
from hpcml.records import CONFIG, RUN_LOG, SUMMARY, write_json_atomic
from hpcml.track.store import (
    TrackingError,
    get_or_create_experiment,
    open_client,
    resolve_tracking_uri,
    stringify,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

TRACKING_FILE = "tracking.json"
EXPORT_DIR = "export"
STATUS_TO_MLFLOW = {
    "finished": "FINISHED",
    "failed": "FAILED",
    "preempted": "KILLED",
    "interrupted": "KILLED",  # Ctrl-C / SIGINT (issue 11)
}
# Fields of a step record that are coordinates or labels, not measurements.
_NOT_METRICS = frozenset({"step", "kind", "epoch", "time", "timestamp", "wall_time", "rank"})
_MAX_QUEUED = 5000  # metric points; bounds memory and the size of one store write
_PARAM_LIMIT = 6000
_TAG_LIMIT = 8000

log = logging.getLogger("hpcml.track")


def numeric_items(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record; bools, strings, None and NaN are not metrics."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def reduce_window(records: list[dict[str, Any]]) -> dict[str, float]:
    """One point per metric for a window of step records.

    Mean for rates and losses (less noisy than one sample), last value for the learning rate
    (a schedule, not a measurement) and the privacy spent (epsilon, which only grows), max for byte counts (memory peaks are what matter).
    """
    values: dict[str, list[float]] = {}
    for record in records:
        for key, value in numeric_items(record).items():
            values.setdefault(key, []).append(value)
    out: dict[str, float] = {}
    for key, vs in values.items():
        if key in ("lr", "epsilon") or key.endswith("_lr"):  # a schedule; privacy spent so far
            out[key] = vs[-1]
        elif key.endswith("_bytes") or key.startswith("peak_"):
            out[key] = max(vs)
        else:
            out[key] = sum(vs) / len(vs)
    return out


def resume_tracking_uri(cfg: TrackingConfig, run_dir: Path, state: dict[str, Any]) -> str:
    """The store a resumed run tracks in: the one its tracking.json records, unless
    `tracking.uri` (or $MLFLOW_TRACKING_URI) names another, which is refused in one sentence."""
    recorded = state.get("tracking_uri")
    explicit = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not isinstance(recorded, str) or not recorded:
        return resolve_tracking_uri(explicit)
    if explicit is None:
        return recorded
    uri = resolve_tracking_uri(explicit)
    if uri != recorded:
        raise TrackingError(
            f"run folder {run_dir} is tracked in MLflow run {state['run_id']} of {recorded} "
            f"({TRACKING_FILE}), but tracking.uri resolves to {uri}; resume with "
            f"tracking.uri={recorded} (or leave it unset), or train into a new run folder to "
            "start a new MLflow run."
        )
    return uri


def check_resume_store(cfg: TrackingConfig, run_dir: Path | None, resume: str | None) -> None:
    """Before a resumed training run writes anything: refuse (TrackingError) a `tracking.uri`
    other than the store its tracking.json records. The tracker checks again at `start`."""
    if resume is None or run_dir is None or cfg.backend != "mlflow":
        return
    state = read_tracking_state(run_dir)
    if state is not None:
        resume_tracking_uri(cfg, run_dir, state)


def read_tracking_state(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / TRACKING_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) and data.get("run_id") else None


class NullTracker:
    """Tracking off (or not rank 0): the same calls, doing nothing."""

    enabled = False
    run_id: str | None = None

    def start(self, params: dict[str, Any], tags: dict[str, str], resume: bool = True) -> None:
        pass

    def log_steps(self, records: list[dict[str, Any]]) -> None:
        pass

    def log_eval(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any], status: str, run_dir: Path) -> None:
        pass


class MlflowTracker:
    """One MLflow run per hpcml run folder; see the module docstring for the contract."""

    enabled = True

    def __init__(self, cfg: TrackingConfig, run_dir: Path, remember: bool = True) -> None:
        """`remember=False` leaves run_dir/tracking.json alone (a folder tracked elsewhere)."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.remember = remember
        self.run_id: str | None = None
        self.artifact_uri: str | None = None
        self.uri: str | None = None
        self.resumed = False
        self._client: MlflowClient | None = None
        self._window: list[dict[str, Any]] = []
        self._queue: list[Metric] = []
        self._last_flush: float | None = None  # never: the first points go out at once
        self._pending: list[Any] = []
        self._failed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, params: dict[str, Any], tags: dict[str, str], resume: bool = True) -> None:
        """Open the MLflow run and log params and tags. With `resume` (a training run resumed
        from a checkpoint) the run tracking.json names is reopened; otherwise a new one is made.

        Raises TrackingError when the store cannot be opened, or a resume names another store
        than the run's: better before training than after.
        """
        state = read_tracking_state(self.run_dir) if resume else None
        wanted = self.cfg.uri if state is None else resume_tracking_uri(self.cfg, self.run_dir, state)
        client, uri = open_client(wanted)
        self._client, self.uri = client, uri
        run = None
        if state is not None and state.get("tracking_uri") == uri:
            run = self._existing_run(state["run_id"])
        all_tags = {**self.cfg.tags, **tags, "hpcml.run_dir": str(self.run_dir.resolve())}
        if run is not None:
            self.resumed = True
            self.run_id, self.artifact_uri = run.info.run_id, run.info.artifact_uri
            client.update_run(self.run_id, status="RUNNING")
            self._log_params_on_resume(run.data.params, params)
            resumes = int(run.data.tags.get("hpcml.resumes", "0")) + 1
            self._set_tags({**all_tags, "hpcml.resumes": str(resumes)})
        else:
            experiment_id = get_or_create_experiment(client, uri, self.cfg.experiment)
            run = client.create_run(
                experiment_id,
                run_name=self.cfg.run_name or self.run_dir.name,
                tags={k: stringify(v, _TAG_LIMIT) for k, v in all_tags.items()},
            )
            self.run_id, self.artifact_uri = run.info.run_id, run.info.artifact_uri
            self._log_params(params)
            if not self.remember:
                return
            write_json_atomic(
                self.run_dir / TRACKING_FILE,
                {
                    "backend": "mlflow",
                    "tracking_uri": uri,
                    "experiment": self.cfg.experiment,
                    "experiment_id": experiment_id,
                    "run_id": self.run_id,
                    "artifact_uri": run.info.artifact_uri,
                },
            )

    def log_steps(self, records: list[dict[str, Any]]) -> None:
        """Queue step records; each full window of `log_every` steps becomes one metric point."""
        if self._client is None or self._failed:
            return
        for record in records:
            if record.get("kind", "step") != "step":
                continue
            self._window.append(record)
            step = int(record.get("step", 0))
            if step % self.cfg.log_every == 0:
                self._queue += self._window_metrics()
        last = self._last_flush
        due = last is None or time.monotonic() - last >= self.cfg.flush_every_s
        if due or len(self._queue) >= _MAX_QUEUED:
            self._flush()

    def log_eval(self, record: dict[str, Any]) -> None:
        """Evaluation points are rare and watched: sent now, with any queued step points."""
        if self._client is None or self._failed:
            return
        step = int(record.get("step", 0))
        self._queue += self._metrics(numeric_items(record), step)
        self._flush()

    def finish(self, summary: dict[str, Any], status: str, run_dir: Path) -> None:
        """Flush metrics, log the summary's numbers, attach artifacts (summary.json from `summary`,
        config.yaml and run.jsonl from `run_dir`, and export/ for a finished run) and close the
        run with FINISHED, FAILED or KILLED (for finished, failed, preempted)."""
        if self._client is None or self.run_id is None:
            return
        client, run_id = self._client, self.run_id
        run_dir = Path(run_dir)
        try:
            self._queue += self._window_metrics()
            step = int(summary.get("steps") or 0)
            self._queue += self._metrics(_summary_metrics(summary), step)
            self._flush()
            self._set_tags(_summary_tags(summary, status))
            _log_dataset(client, run_id, summary.get("data") or {}, summary.get("config") or {})
            self._wait()
            # From the dict: the engine calls finish before it writes summary.json.
            client.log_dict(run_id, summary, SUMMARY)
            for name in (CONFIG, RUN_LOG):
                if (run_dir / name).is_file():
                    client.log_artifact(run_id, str(run_dir / name))
            if status == "finished" and (run_dir / EXPORT_DIR).is_dir():
                client.log_artifacts(run_id, str(run_dir / EXPORT_DIR), EXPORT_DIR)
        except Exception as exc:  # noqa: BLE001 - see _warn
            self._warn(exc)
        try:
            client.set_terminated(run_id, status=STATUS_TO_MLFLOW.get(status, "FAILED"))
        except Exception as exc:  # noqa: BLE001 - see _warn
            self._warn(exc)
        self._client = None

    # -- internals ---------------------------------------------------------------------------

    def _existing_run(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        assert self._client is not None
        try:
            run = self._client.get_run(run_id)
        except MlflowException:
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        assert self._client is not None and self.run_id is not None
        items = [Param(k, stringify(v, _PARAM_LIMIT)) for k, v in params.items()]
        self._client.log_batch(self.run_id, params=items)

    def _log_params_on_resume(self, logged: dict[str, str], params: dict[str, Any]) -> None:
        # MLflow params are write-once: log keys the run lacks; record changed values as tags.
        new = {k: v for k, v in params.items() if k not in logged}
        if new:
            self._log_params(new)
        changed = {
            k: stringify(v, _PARAM_LIMIT)
            for k, v in params.items()
            if k in logged and logged[k] != stringify(v, _PARAM_LIMIT)
        }
        if changed:
            self._set_tags({f"hpcml.resume_param.{k}": v for k, v in changed.items()})

    def _set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        assert self._client is not None and self.run_id is not None
        items = [RunTag(k, stringify(v, _TAG_LIMIT)) for k, v in tags.items()]
        self._pending.append(self._client.log_batch(self.run_id, tags=items, synchronous=False))

    def _window_metrics(self) -> list[Metric]:
        if not self._window:
            return []
        step = int(self._window[-1].get("step", 0))
        reduced = reduce_window(self._window)
        self._window = []
        return self._metrics(reduced, step)

    def _metrics(self, values: dict[str, float], step: int) -> list[Metric]:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        return [Metric(k, v, now_ms, step) for k, v in values.items()]

    def _flush(self) -> None:
        metrics, self._queue = self._queue, []
        self._last_flush = time.monotonic()
        if not metrics or self._client is None or self.run_id is None or self._failed:
            return
        try:
            ops = self._client.log_batch(self.run_id, metrics=metrics, synchronous=False)
        except Exception as exc:  # noqa: BLE001 - see _warn
            self._warn(exc)
            return
        self._pending.append(ops)
        if len(self._pending) > 64:
            # Bound the futures kept; the queue is FIFO, so the oldest are long done.
            self._pending = self._pending[-16:]

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for ops in pending:
            if ops is not None:
                ops.wait()

    def _warn(self, exc: BaseException) -> None:
        if not self._failed:
            log.warning(
                "tracking to %s failed (%s: %s); training goes on, the MLflow run %s may be "
                "incomplete.",
                self.uri,
                type(exc).__name__,
                str(exc).splitlines()[0][:300] if str(exc) else "",
                self.run_id,
            )
        self._failed = True


def _summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """final/*, throughput/* and rank 0's memory/* as metrics, so runs compare in the UI."""
    out: dict[str, float] = {}
    for section in ("final", "throughput", "privacy"):
        for key, value in numeric_items(summary.get(section) or {}).items():
            out[f"{section}/{key}"] = value
    rank0 = _first_rank(summary.get("memory"))
    for key, value in numeric_items(rank0 or {}).items():
        out[f"memory/{key}"] = value
    return out


def _first_rank(memory: Any) -> dict[str, Any]:
    """Rank 0's entry of a per-rank memory section (a list, or a dict of dicts in rank order)."""
    if isinstance(memory, list):
        return memory[0] if memory and isinstance(memory[0], dict) else {}
    if isinstance(memory, dict):
        if "per_rank" in memory:  # a run's summary: its top level is rank 0's
            return memory
        # Keyed by rank only when every value is a rank's entry: a summary's memory block also
        # holds dicts of its own (`traced_at_peak`, bytes by kind), which are not ranks.
        nested = list(memory.values())
        if nested and all(isinstance(v, dict) for v in nested):
            return nested[0]  # type: ignore[no-any-return]
        return memory
    return {}


def _summary_tags(summary: dict[str, Any], status: str) -> dict[str, str]:
    tags = {"hpcml.status": status}
    if summary.get("error"):
        tags["hpcml.error"] = str(summary["error"])
    for key in ("world_size", "precision", "steps"):
        if summary.get(key) is not None:
            tags[f"hpcml.{key}"] = str(summary[key])
    device = summary.get("device") or {}
    for key in ("type", "name", "count"):
        if device.get(key) is not None:
            tags[f"hpcml.device.{key}"] = str(device[key])
    model = summary.get("model") or {}
    for key in ("name", "parameters", "forward_flops_per_sample"):
        if model.get(key) is not None:
            tags[f"hpcml.model.{key}"] = str(model[key])
    return tags


def _log_dataset(
    client: MlflowClient, run_id: str, data: dict[str, Any], config: dict[str, Any]
) -> None:
    """Each shard set version the run read (more than one after a resume with
    --allow-data-change) becomes one of the run's MLflow training dataset inputs: name and
    location, the first 36 hex digits of its version as the digest (MLflow's column holds 36),
    the whole version in the source JSON, and MLflow's source type for where it was read (`s3`
    for a bucket, `local` for a folder, given as an absolute path)."""
    read = data.get("versions_read")
    if read is None and data.get("version"):  # a summary written before versions_read
        read = [{"version": data["version"], "path": (config.get("data") or {}).get("path")}]
    read = [r for r in read or [] if isinstance(r, dict) and r.get("version")]
    if not read:
        return
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for r in read:
        path = str(r.get("path") or "")
        source_type, uri = dataset_location(path)
        dataset = Dataset(
            name=Path(uri.rstrip("/")).name or "shards",
            digest=str(r["version"])[:36],
            source_type=source_type,
            source=json.dumps({"uri": uri, "version": r["version"], "location": path}),
        )
        inputs.append(DatasetInput(dataset, [InputTag("mlflow.data.context", "training")]))
    client.log_inputs(run_id, inputs)


def dataset_location(path: str) -> tuple[str, str]:
    """MLflow's dataset source type and URI for data.path: `s3` and the URL without its
    query (endpoint options), or `local` and the absolute folder."""
    if path.startswith("s3://"):
        return "s3", path.split("?", 1)[0]
    return "local", str(Path(path).expanduser().resolve()) if path else ""


def make_tracker(cfg: TrackingConfig, run_dir: Path) -> MlflowTracker | NullTracker:
    """The tracker for this process: MLflow on rank 0 when `tracking.backend: mlflow`."""
    if cfg.backend == "none" or int(os.environ.get("RANK", "0")) != 0:
        return NullTracker()
    return MlflowTracker(cfg, run_dir)
