"""Where a study lives, and the trials whose worker died.

The default is Optuna's journal storage in `--out` (`journal:OUT/study.journal`): an
append-only log of the study's operations that every worker replays, locked with Optuna's
symlink lock (`JournalFileSymlinkLock`, which Optuna documents for NFS as well as local
disks), so workers on several nodes can share it through a shared filesystem. `--storage`
also takes `journal:PATH` or an SQLAlchemy URL for Optuna's RDB storage (`sqlite:///...`,
`postgresql+psycopg://...`).

A worker that dies leaves its trial RUNNING. On its own host the next worker sees that the
process is gone and fails the trial at once. Elsewhere its heartbeat tells: the RDB storage
has Optuna's (a thread in the worker); the journal storage has none, so the tuner writes the
trial's `heartbeat` user attribute every `HEARTBEAT_S` and a trial whose last beat is
`GRACE_S` old is failed. Either way the trial is queued again with the same parameters
(Optuna's RetryHeartbeatStaleTrialCallback) and only its retry counts. The retry starts clean:
Optuna's callback copies the dead attempt's system and user attributes, among them the
pruner's `completed_rung_N` (a retry that inherited rung 0 was first judged at rung 1, so it
passed the rung where it should have been pruned) and its `heartbeat` (a retry on another host
looked dead before its own first beat); `Requeue` drops what belonged to that attempt.
The dead attempt itself keeps its rung values (a finished trial's attributes cannot change),
and successive halving compares a trial with every trial's rung value, failed ones included:
the retry would compete with its own dead attempt. `WithoutRetriedAttempts` hides attempts
that were queued again from successive halving (`asha`). Hyperband's brackets read the
storage themselves, so there a dead attempt still counts once more at its rungs.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import FrozenTrial, TrialState

from hpcml.errors import ConfigError
from hpcml.tune import trial as trial_run
from hpcml.tune.report import retried_numbers

HEARTBEAT_S = 10
"""A running trial's heartbeat (one small write to the storage)."""
GRACE_S = 60
"""A trial whose heartbeat is this old is failed and retried (workers on other hosts)."""
MAX_RETRY = 2
"""A trial killed this many times is not queued again."""
JOURNAL = "journal:"


def default_storage(out: Path) -> str:
    return f"{JOURNAL}{(out / 'study.journal').resolve()}"


def open_storage(url: str) -> BaseStorage:
    """The storage `url` names (bad input raises ConfigError, the storage unchanged)."""
    if url.startswith(JOURNAL):
        return _journal(Path(url[len(JOURNAL) :]))
    # SQLite serialises writers: wait for the lock rather than fail a busy worker's write.
    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else {}
    try:
        return RDBStorage(
            url,
            engine_kwargs=engine,
            heartbeat_interval=HEARTBEAT_S,
            grace_period=GRACE_S,
            heartbeat_stale_trial_callback=Requeue(MAX_RETRY),
        )
    except Exception as exc:  # SQLAlchemy's errors for a URL or server that cannot be used
        raise ConfigError(
            f"study storage {url} cannot be opened ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); check the --storage URL and that it is reachable."
        ) from None


ATTEMPT_SYSTEM_ATTRS = ("completed_rung_", "constraints:")
"""Prefixes of system attributes that one attempt of a trial wrote: successive halving's rungs
(hyperband's brackets keep theirs under the same keys) and the planner's constraint, which the
retry sets again."""
ATTEMPT_USER_ATTRS = frozenset(
    {"worker", "heartbeat", "run_dir", "steps", "samples", "samples_per_step", "error",
     "predicted_bytes", "infeasible"}
)  # fmt: skip
"""User attributes of one attempt (hpcml.tune.study sets each again for the retry)."""


class Requeue(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a trial whose worker died (same parameters, its retry history), less
    what the dead attempt wrote (see the module docstring)."""

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        clean = copy.copy(trial)
        system: dict[str, Any] = {
            k: v for k, v in trial.system_attrs.items() if not k.startswith(ATTEMPT_SYSTEM_ATTRS)
        }
        # Optuna's callback appends to the history list it finds: give it a copy.
        if "retry_history" in system:
            system["retry_history"] = list(system["retry_history"])
        clean.system_attrs = system
        clean.user_attrs = {
            k: v for k, v in trial.user_attrs.items() if k not in ATTEMPT_USER_ATTRS
        }
        super().__call__(study, clean)


class WithoutRetriedAttempts(optuna.pruners.BasePruner):
    """`inner` (successive halving) judging each trial against a study without the attempts
    that were queued again: their retries stand for them."""

    def __init__(self, inner: optuna.pruners.BasePruner) -> None:
        self.inner = inner

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.inner.prune(_LiveAttempts(study), trial)  # type: ignore[arg-type]


class _LiveAttempts:
    """A study whose get_trials leaves out attempts queued again (everything else its own)."""

    def __init__(self, study: optuna.Study) -> None:
        self._live = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._live, name)

    def get_trials(
        self, deepcopy: bool = True, states: tuple[TrialState, ...] | None = None
    ) -> list[FrozenTrial]:
        every = self._live.get_trials(deepcopy=deepcopy)  # one read: retries name any state
        retried = retried_numbers(every)
        return [
            t for t in every
            if t.number not in retried and (states is None or t.state in states)
        ]  # fmt: skip


def _journal(path: Path) -> JournalStorage:
    if not path.parent.is_dir():
        raise ConfigError(
            f"study storage {JOURNAL}{path} cannot be opened: its folder {path.parent} does not "
            "exist; create it or give another --storage."
        )
    if path.is_dir():
        raise ConfigError(
            f"study storage {JOURNAL}{path} is a folder, not a journal file; name a file."
        )
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except Exception as exc:  # unreadable, or not a journal (its lines are not Optuna's JSON)
        raise ConfigError(
            f"study storage {JOURNAL}{path} cannot be opened ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'unreadable'}); give a journal "
            "file that hpcml tune wrote, or a new path."
        ) from None


def beats_itself(storage: BaseStorage) -> bool:
    """Whether Optuna's own heartbeat watches the storage's running trials (RDB)."""
    return isinstance(storage, BaseHeartbeat)


def last_beat(t: FrozenTrial) -> float:
    beat = t.user_attrs.get("heartbeat")
    if beat is not None:
        return float(beat)
    return t.datetime_start.timestamp() if t.datetime_start is not None else time.time()


def dead(t: FrozenTrial, beats: bool, now: float) -> bool:
    """Whether the trial's worker is gone: seen on this host, or by its heartbeat elsewhere."""
    alive = trial_run.worker_alive(t.user_attrs.get("worker", {}))
    if alive is not None:
        return not alive
    return not beats and now - last_beat(t) > GRACE_S


def fail_dead_trials(study: optuna.Study) -> None:
    """Fail (and queue again) RUNNING trials whose worker is gone."""
    optuna.storages.fail_stale_trials(study)  # the RDB storage's heartbeat
    retry = Requeue(MAX_RETRY)
    storage, beats, now = study._storage, beats_itself(study._storage), time.time()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not dead(t, beats, now):
            continue
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            if storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                retry(study, storage.get_trial(t._trial_id))
                if "run_dir" in t.user_attrs:
                    trial_run.write_trial_file(
                        Path(t.user_attrs["run_dir"]),
                        {"trial": t.number, "params": t.params, "status": "failed",
                         "error": "its tune worker died; the trial was queued again"},
                    )  # fmt: skip


def known_trials(storage: str, name: str) -> int:
    """How many trials study `name` holds (0 when it does not exist yet)."""
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        return 0
    return len(study.get_trials(deepcopy=False))


def heartbeat(t: optuna.Trial, storage: Any) -> Any:
    """What the trial's run calls every HEARTBEAT_S: a beat where Optuna has none."""
    if beats_itself(storage):
        return lambda: None
    return lambda: t.set_user_attr("heartbeat", time.time())
