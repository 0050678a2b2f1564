"""A study over `hpcml train` runs: Optuna's study, sampler, pruner and storage (a journal file
in `--out` by default; hpcml.tune.storage), shared by every worker, on this machine or
elsewhere.

Each worker loops: under a lock on `OUT/.tune.lock` it counts the study's trials and, while
fewer than `--trials` are done or running (and the largest trial fits in what is left of
`tune.step_budget` and `tune.sample_budget`: hpcml.tune.budget), starts one
(`study.optimize` with one trial, so Optuna's heartbeat and stale-trial handling run as
usual). A trial is a real `hpcml train` in
`OUT/trials/trial-NNNN` (hpcml.tune.trial), forked from the worker's warm launcher
(hpcml.tune.launcher: torch imported once per worker, not once per trial); one the planner
predicts will not fit `tune.device` is recorded infeasible (pruned, with Optuna's constraint > 0) and never started.

A worker that dies (kill -9, a crash) leaves its trial RUNNING, failed and queued again by the
next worker (hpcml.tune.storage.fail_dead_trials). Running the same command again continues
the study up to `--trials`; no finished trial runs again.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hpcml.config import RunConfig, TuneConfig, apply_overrides, build_config, load_yaml
from hpcml.errors import ConfigError, HpcmlError, WorkFailed
from hpcml.tune import budget, feasible, guard, space, tracking
from hpcml.tune import trial as trial_run
from hpcml.tune.launcher import OnDemand, preload_for
from hpcml.tune.report import EVAL_SAMPLES_ATTR, counts, summary, write_report
from hpcml.tune.storage import (
    HEARTBEAT_S,
    MAX_RETRY,
    Requeue,
    WithoutRetriedAttempts,
    fail_dead_trials,
    heartbeat,
    open_storage,
)

WAIT_S = 0.5
"""A worker with nothing to start (the others' trials fill the budget) looks again this often."""
LOCK_FILE = ".tune.lock"

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
SCORES = ("val_loss", "val_accuracy")
"""The scores every evaluation reports (hpcml.train.evaluation), and each train.eval_sets set
as NAME/val_loss and NAME/val_accuracy (hpcml.train.eval_sets): what tune.metric may name."""


@dataclass(frozen=True)
class TuneJob:
    """What every worker needs (picklable: workers are started with multiprocessing)."""

    config: Path
    overrides: tuple[str, ...]
    out: Path
    storage: str
    study: str
    trials: int
    nproc: int = 1
    timeout_s: float | None = None
    started: float = field(default_factory=time.time)
    known: int = 0
    """Trials the study held when this tune started (see make_sampler)."""
    first_worker: int = 0
    """The number of this tune's first worker (SLURM array tasks: the task id), which seeds
    its sampler."""
    step_budget: int | None = None
    """tune.step_budget: training steps the study's trials may take in all."""
    trial_steps: int = 0
    """The most steps one trial can train (what a running trial counts against the budget)."""
    sample_budget: int | None = None
    """tune.sample_budget: training samples the study's trials may take in all."""
    trial_samples: int = 0
    """The most samples one trial can train (budget.trial_samples)."""

    def limits(self) -> list[budget.Limit]:
        """The study's budgets (none, one or both)."""
        out: list[budget.Limit] = []
        if self.step_budget is not None:
            out.append(budget.Limit("steps", self.step_budget, self.trial_steps))
        if self.sample_budget is not None:
            out.append(budget.Limit("samples", self.sample_budget, self.trial_samples))
        return out


@dataclass(frozen=True)
class Prepared:
    cfg: RunConfig
    tune: TuneConfig
    base: dict[str, Any]
    dists: dict[str, Any]

    @property
    def tracked(self) -> bool:
        return tracking.enabled(self.cfg)


class TrialRunFailed(Exception):
    """The trial's run failed (its exit code and last line are in the trial's user attrs)."""


def prepare(config: Path, overrides: tuple[str, ...]) -> Prepared:
    """Load the config, check its `tune` section and space (bad input raises ConfigError)."""
    base = apply_overrides(load_yaml(config), list(overrides))
    origin = f"{config}" + (" with overrides " + " ".join(overrides) if overrides else "")
    cfg = build_config(base, origin)
    if cfg.tune is None:
        raise ConfigError(
            f"{config} has no tune section; add one with a metric and a space "
            "(see examples/tune_digits.yaml)."
        )
    check_metric(cfg)
    dists = space.distributions(cfg.tune, base)
    if cfg.tune.sampler == "grid":
        space.grid(dists)
    budget.check(cfg.tune, cfg, dists)
    feasible.check_device(cfg.tune)
    return Prepared(cfg, cfg.tune, base, dists)


def check_metric(cfg: RunConfig) -> None:
    """tune.metric must be a score the trials' evaluations report (checked again in each
    evaluation record: hpcml.tune.trial)."""
    assert cfg.tune is not None
    known = [*SCORES, *(f"{name}/{m}" for name in cfg.train.eval_sets or {} for m in SCORES)]
    if cfg.tune.metric not in known:
        raise ConfigError(
            f"tune.metric '{cfg.tune.metric}' is not among the metrics an evaluation reports "
            f"({', '.join(known)}); set tune.metric to one of them."
        )


def make_sampler(tune: TuneConfig, dists: dict[str, Any], worker: int, known: int = 0) -> Any:
    """The sampler of one worker. Its seed differs per worker (two workers with one seed
    would propose the same points) and per resumption (`known`: trials the study held when
    this tune started; with the first invocation's seed a resumed study would propose the
    points it already tried)."""
    seed = (tune.seed + worker + 1000 * known) % 2**32  # NumPy's seeds end at 2^32 - 1
    s = optuna.samplers
    startup: dict[str, Any] = (
        {} if tune.startup_trials is None else {"n_startup_trials": tune.startup_trials}
    )
    if tune.sampler == "tpe":
        # constant_liar: a running trial counts as a bad result, so parallel workers spread out.
        return s.TPESampler(seed=seed, constant_liar=True, **startup)
    if tune.sampler == "random":
        return s.RandomSampler(seed=seed)
    if tune.sampler == "grid":
        return s.GridSampler(space.grid(dists), seed=seed)
    if tune.sampler == "cmaes":
        return s.CmaEsSampler(seed=seed, **startup)
    return s.QMCSampler(seed=seed)


def make_pruner(
    tune: TuneConfig, cfg: RunConfig, dists: dict[str, Any] | None = None
) -> optuna.pruners.BasePruner:
    """Rungs start at budget.first_rung (by default the first evaluation after the warmup),
    each budget.reduction_factor times the one before; hyperband's largest budget is the
    longest trial."""
    first = budget.first_rung(tune, cfg, dists or {})
    eta = budget.reduction_factor(tune, cfg, dists or {})
    p = optuna.pruners
    if tune.pruner == "asha":
        inner = p.SuccessiveHalvingPruner(min_resource=first, reduction_factor=eta)
        return WithoutRetriedAttempts(inner)
    if tune.pruner == "hyperband":
        return p.HyperbandPruner(
            min_resource=first,
            max_resource=budget.trial_steps(cfg, dists or {}),
            reduction_factor=eta,
        )
    if tune.pruner == "median":
        return p.MedianPruner(n_startup_trials=2, n_warmup_steps=first)
    return p.NopPruner()


def load_study(job: TuneJob, prep: Prepared, worker: int = 0) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # hpcml prints its own lines
    storage = open_storage(job.storage)
    sampler = make_sampler(prep.tune, prep.dists, job.first_worker + worker, job.known)
    pruner = make_pruner(prep.tune, prep.cfg, prep.dists)
    try:  # load first: the journal's create_study appends to the file even for a known name
        study = optuna.load_study(
            study_name=job.study, storage=storage, sampler=sampler, pruner=pruner
        )
    except KeyError:
        study = optuna.create_study(
            storage=storage, study_name=job.study, direction=prep.tune.direction,
            sampler=sampler, pruner=pruner, load_if_exists=True,
        )  # fmt: skip
    if study.direction.name.lower() != prep.tune.direction:
        raise ConfigError(
            f"study '{job.study}' in {job.storage} is set to {study.direction.name.lower()}, "
            f"but tune.direction is {prep.tune.direction}; keep the study's direction or use "
            "another --out or --storage."
        )
    return study


class StudyLock:
    """One worker at a time counts the trials and starts one (two could overshoot `--trials`).
    An flock on a file in `--out`: it holds among the workers of one machine."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / LOCK_FILE
        self._f: Any = None

    def acquire(self) -> None:
        self._f = open(self.path, "a+")  # noqa: SIM115 - closed in release()
        fcntl.flock(self._f, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._f is not None:
            self._f.close()  # closing the file releases the lock
            self._f = None


def next_action(study: optuna.Study, job: TuneJob, sampler: Any) -> str:
    """'run' a trial, 'wait' for the others' running trials, or 'done'."""
    fail_dead_trials(study)
    trials = study.get_trials(deepcopy=False)
    n = counts(trials)
    done = n["complete"] + n["pruned"] + n["failed"] + n["infeasible"]
    if done >= job.trials:
        return "done"
    if not all(limit.fits(trials) for limit in job.limits()):
        # a running trial pruned early gives steps back: another may fit then
        return "wait" if n["running"] else "done"
    if job.timeout_s is not None and time.time() - job.started >= job.timeout_s:
        return "done"
    if isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study):
        return "done"
    return "wait" if done + n["running"] >= job.trials else "run"


def work(job: TuneJob, worker: int = 0, say: Callable[[str], None] = lambda _line: None) -> None:
    """One worker: run trials until the study holds `job.trials` finished ones."""
    prep = prepare(job.config, job.overrides)
    # Started by this thread, which runs the trials: the launcher dies with it.
    launcher = OnDemand(preload_for(prep.cfg))
    try:
        study = load_study(job, prep, worker)
        lock = StudyLock(job.out)
        while True:
            lock.acquire()
            try:
                action = next_action(study, job, study.sampler)
                if action == "run":  # releases the lock once it has a trial
                    run_one(study, job, prep, lock, say, launcher)
            finally:
                lock.release()
            if action == "done":
                return
            if action == "wait":
                time.sleep(WAIT_S)
    finally:
        launcher.close()


def run_one(
    study: optuna.Study,
    job: TuneJob,
    prep: Prepared,
    lock: StudyLock,
    say: Callable[[str], None],
    launcher: OnDemand | None = None,
) -> None:
    started: list[int] = []

    def objective(t: optuna.Trial) -> float:
        # Whose trial it is, before another worker may look at it (a queued retry still
        # names the dead worker it was copied from).
        t.set_user_attr("worker", trial_run.worker_identity())
        lock.release()  # the trial exists now: other workers may count it
        started.append(t._trial_id)
        return objective_body(t, job, prep, say, launcher)

    try:
        study.optimize(objective, n_trials=1, catch=(TrialRunFailed,))
    except KeyboardInterrupt:
        # The run was stopped at a step boundary; queue the trial again for the next tune.
        if started:
            Requeue(MAX_RETRY)(study, study._storage.get_trial(started[0]))
        raise


def objective_body(
    t: optuna.Trial,
    job: TuneJob,
    prep: Prepared,
    say: Callable[[str], None],
    launcher: OnDemand | None = None,
) -> float:
    params = space.suggest(t, prep.dists)
    data = prep.base
    for key, value in params.items():
        data = space.set_dotted(data, key, value)
    cfg = build_config(data, origin=f"trial {t.number}")
    reason = _infeasible(t, cfg, job, prep)
    if reason is not None:
        say(f"trial {t.number}: infeasible, not started: {reason}")
        _track(prep, t, "infeasible", None, params, say)
        raise optuna.TrialPruned(reason)
    run_dir = job.out / "trials" / f"trial-{t.number:04d}"
    t.set_user_attr("run_dir", str(run_dir))
    per_step = budget.samples_per_step(cfg, job.nproc)
    t.set_user_attr(budget.PER_STEP_ATTR, per_step)  # a dead worker's trial counts with it
    extra = tracking.trial_overrides(prep.cfg, t.study, t.number) if prep.tracked else []
    args = [*job.overrides, *space.overrides(params), *extra]
    command = trial_run.train_command(job.config, args, run_dir, job.nproc)

    def report(points: list[tuple[int, float]]) -> bool:
        for step, value in points:
            t.report(value, step)
        return t.should_prune()

    info = {"study": job.study, "storage": job.storage, "trial": t.number, "params": params}
    try:
        outcome = trial_run.run(
            command, run_dir, prep.tune.metric, report, cfg.train.max_steps,
            heartbeat(t, t.study._storage), HEARTBEAT_S, launcher.get() if launcher else None,
        )  # fmt: skip
    except BaseException:
        trial_run.write_trial_file(run_dir, {**info, "status": "failed", "error": "stopped"})
        raise
    t.set_user_attr(budget.STEPS_ATTR, outcome.steps)
    if outcome.state == "complete" and outcome.eval_samples is not None:
        t.set_user_attr(EVAL_SAMPLES_ATTR, outcome.eval_samples)
    t.set_user_attr(budget.SAMPLES_ATTR, outcome.steps * per_step)
    trial_run.write_trial_file(
        run_dir,
        {**info, "status": outcome.state, "value": outcome.value, "step": outcome.step,
         "steps": outcome.steps, "samples": outcome.steps * per_step, "error": outcome.error},
    )  # fmt: skip
    say(_describe(t.number, outcome, prep.tune.metric, run_dir))
    _track(prep, t, outcome.state, run_dir, params, say)
    if outcome.state == "pruned":
        raise optuna.TrialPruned(f"pruned at step {outcome.step}")
    if outcome.state == "failed":
        t.set_user_attr("error", outcome.error)
        raise TrialRunFailed(outcome.error)
    assert outcome.value is not None
    return outcome.value


def _infeasible(t: optuna.Trial, cfg: RunConfig, job: TuneJob, prep: Prepared) -> str | None:
    """Why the planner says the trial's config will not fit `tune.device`, or None."""
    fit = feasible.memory_fit(cfg, job.nproc, prep.tune)
    if fit is None:
        return None
    t.set_user_attr("predicted_bytes", fit.predicted_bytes)
    t.set_constraint("memory", fit.violation)
    if fit.fits:
        return None
    t.set_user_attr("infeasible", fit.reason())
    return fit.reason()


def _track(
    prep: Prepared,
    t: optuna.Trial,
    state: str,
    run_dir: Path | None,
    params: dict[str, Any],
    say: Callable[[str], None],
) -> None:
    if not prep.tracked:
        return
    try:
        tracking.record_trial(prep.cfg, t.study, t.number, state, run_dir, params)
    except Exception as exc:  # a tracking store that fails mid-study must not stop the study
        say(f"warning: trial {t.number} not tagged in MLflow ({type(exc).__name__}: {exc})")


def _describe(number: int, o: trial_run.Outcome, metric: str, run_dir: Path) -> str:
    if o.state == "failed":
        return f"trial {number}: failed ({o.error}); see {run_dir}"
    return f"trial {number}: {o.state} at step {o.step}, {metric} {o.value:.4f} ({run_dir})"


def say_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _error_file(job: TuneJob, worker: int) -> Path:
    return job.out / f".worker-{worker}.error"


def _child(job: TuneJob, worker: int, verbose: bool) -> None:
    """A worker process: dies with the tuner (kill -9 of the tuner leaves nothing running).
    Its error's sentence goes to the tuner, which prints it once."""
    guard.die_with_parent(signal.SIGKILL)
    try:
        work(job, worker, say_stderr if verbose else lambda _line: None)
    except HpcmlError as exc:
        error = {"message": exc.message, "exit_code": exc.exit_code}
        trial_run.write_trial_file_at(_error_file(job, worker), error)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def run_workers(job: TuneJob, workers: int, verbose: bool) -> None:
    """`workers` workers on one study: this process and `workers - 1` started beside it."""
    say = say_stderr if verbose else (lambda _line: None)
    ctx = multiprocessing.get_context("spawn")  # no SQLAlchemy connection crosses a fork
    procs = [ctx.Process(target=_child, args=(job, i, verbose)) for i in range(1, workers)]
    for i in range(1, workers):
        _error_file(job, i).unlink(missing_ok=True)
    for p in procs:
        p.start()
    try:
        work(job, 0, say)
    except BaseException:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGINT)  # each stops its run at a step boundary
        raise
    finally:
        for p in procs:
            p.join()
    _raise_worker_error(job, [(i, p.exitcode) for i, p in enumerate(procs, 1) if p.exitcode])


def _raise_worker_error(job: TuneJob, failed: list[tuple[int, int | None]]) -> None:
    for worker, _code in failed:
        path = _error_file(job, worker)
        if path.exists():
            error = json.loads(path.read_text())
            path.unlink()
            exc = HpcmlError(error["message"])
            exc.exit_code = int(error["exit_code"])
            raise exc
    if failed:
        raise WorkFailed(
            f"{len(failed)} tune workers failed (exit codes {[c for _, c in failed]}); the "
            "study keeps what they finished: run the same command to continue it."
        )


def run_study(job: TuneJob, workers: int, verbose: bool, report: bool = False) -> dict[str, Any]:
    """Run the study's workers, then return its summary (and put it on the MLflow parent;
    with `report`, write OUT/report/index.html)."""
    prep = prepare(job.config, job.overrides)
    if prep.tracked:  # the parent first, so that every worker finds it in the study
        lock = StudyLock(job.out)  # tunes started together (a SLURM array) make one parent
        lock.acquire()
        try:
            tracking.open_parent(prep.cfg, load_study(job, prep), job.storage)
        finally:
            lock.release()
    run_workers(job, workers, verbose)
    study = load_study(job, prep)
    result = summary(study, job.storage, prep.tune.metric)
    if report:
        result["report"] = str(write_report(study, job.out / "report", result))
    if prep.tracked:
        tracking.close_parent(prep.cfg, study, result)
    return result
