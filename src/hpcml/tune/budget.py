"""How far a study may go: where its pruners' rungs are (`tune.first_rung`,
`tune.reduction_factor`) and how many training steps or samples its trials may take in all
(`tune.step_budget`, `tune.sample_budget`).

The first rung defaults to the first evaluation after the longest learning-rate warmup the
space allows: during its warmup a trial trains at a fraction of its learning rate, so a longer
warmup looks worse at an early evaluation for no reason that lasts, and a pruner judging there
stops the trials that would have been best at the end.

Each budget is a hard cap: a trial starts only if the largest run the space allows fits in
what the study has left, counting each finished trial's steps (or samples) as it ran them (a
pruned trial's fewer) and each running one at that largest run. A trial's samples are its
steps times its global batch, so a budget of samples charges a step of batch 64 four times a
step of batch 16, as the machine does (a step's time grows with its batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from hpcml.config import RunConfig, TuneConfig
from hpcml.errors import ConfigError

STEPS_ATTR = "steps"
"""User attribute of a trial: the training steps its run took (its last step record)."""
SAMPLES_ATTR = "samples"
"""User attribute of a trial: the training samples its run took (steps x global batch)."""
PER_STEP_ATTR = "samples_per_step"
"""User attribute of a trial, set before its run starts: its global batch."""

Unit = Literal["steps", "samples"]


def largest(dists: dict[str, BaseDistribution], key: str, default: int) -> int:
    """The largest value the space gives `key` (an int setting), or `default` when the space
    does not search it."""
    d = dists.get(key)
    if d is None:
        return default
    if isinstance(d, CategoricalDistribution):
        return int(max((v for v in d.choices if isinstance(v, int | float)), default=default))
    assert isinstance(d, FloatDistribution | IntDistribution)
    return int(d.high)


def trial_steps(cfg: RunConfig, dists: dict[str, BaseDistribution]) -> int:
    """The most steps one trial can train."""
    return largest(dists, "train.max_steps", cfg.train.max_steps)


def samples_per_step(cfg: RunConfig, nproc: int) -> int:
    """The global batch of a run of `cfg` on `nproc` processes (hpcml.train.validate derives
    the same: global_batch, or batch_size x grad_accum x data-parallel processes)."""
    if cfg.train.global_batch is not None:
        return cfg.train.global_batch
    dp = max(1, nproc // (cfg.parallel.tp * cfg.parallel.pp))
    return cfg.data.batch_size * cfg.train.grad_accum * dp


def trial_samples(cfg: RunConfig, dists: dict[str, BaseDistribution], nproc: int) -> int:
    """The most samples one trial can train: its longest run at its largest global batch."""
    split = any(k in dists for k in ("parallel.tp", "parallel.pp"))
    dp = nproc if split else max(1, nproc // (cfg.parallel.tp * cfg.parallel.pp))
    derived = (
        largest(dists, "data.batch_size", cfg.data.batch_size)
        * largest(dists, "train.grad_accum", cfg.train.grad_accum)
        * dp
    )
    if "train.global_batch" in dists:  # its choices may hold null (derived) beside numbers
        per_step = max(derived, largest(dists, "train.global_batch", 0))
    else:
        per_step = cfg.train.global_batch or derived
    return trial_steps(cfg, dists) * per_step


def first_rung(tune: TuneConfig, cfg: RunConfig, dists: dict[str, BaseDistribution]) -> int:
    """The step of the pruners' first rung (see the module docstring)."""
    if tune.first_rung is not None:
        return tune.first_rung
    every = cfg.train.eval_every or cfg.train.max_steps
    warmup = largest(dists, "optim.warmup_steps", cfg.optim.warmup_steps)
    return min((warmup // every + 1) * every, trial_steps(cfg, dists))


def reduction_factor(tune: TuneConfig, cfg: RunConfig, dists: dict[str, BaseDistribution]) -> int:
    """The pruners' factor between rungs: `tune.reduction_factor`, or 3 (Optuna's default)
    unless 3 leaves a single rung that acts before the longest trial's end and 2 leaves more.
    A rung acts at the first evaluation at or after its step; one that acts only at the end
    stops nothing (the trial has run all its steps). In examples/tune_digits.yaml (first rung
    20, an evaluation every 20, 60 steps) 3 puts the second rung at 60, the end, and 2 at 40."""
    if tune.reduction_factor is not None:
        return tune.reduction_factor
    first, end = first_rung(tune, cfg, dists), trial_steps(cfg, dists)
    every = cfg.train.eval_every or end

    def rungs(eta: int) -> int:
        acting: set[int] = set()
        rung = first
        while rung < end:
            acting.add(min(-(-rung // every) * every, end))  # the evaluation at or after it
            rung *= eta
        return len(acting - {end})

    return 2 if rungs(3) < 2 <= rungs(2) else 3


def check(tune: TuneConfig, cfg: RunConfig, dists: dict[str, BaseDistribution]) -> None:
    """A first rung past every trial's end, or a budget smaller than one trial: ConfigError."""
    longest = trial_steps(cfg, dists)
    if tune.first_rung is not None and tune.first_rung > longest:
        raise ConfigError(
            f"tune.first_rung {tune.first_rung} is past the trials' last step ({longest}), so "
            f"no trial could be pruned; give at most {longest}, or null for after the warmup."
        )
    if tune.step_budget is not None and tune.step_budget < longest:
        raise ConfigError(
            f"tune.step_budget {tune.step_budget} is smaller than one trial ({longest} steps), "
            f"so no trial could start; give at least {longest}, or null for no limit."
        )


def check_samples(tune: TuneConfig, largest_trial: int) -> None:
    """A sample budget smaller than the largest trial (`trial_samples`): ConfigError."""
    if tune.sample_budget is not None and tune.sample_budget < largest_trial:
        raise ConfigError(
            f"tune.sample_budget {tune.sample_budget} is smaller than the largest trial "
            f"({largest_trial} samples: its most steps times its largest global batch), so no "
            f"trial could start; give at least {largest_trial}, or null for no limit."
        )


def taken(trial: FrozenTrial, running: int, unit: Unit = "steps") -> int:
    """What `trial` counts against a budget of `unit`: `running` while it runs or waits to,
    else what its run took (as far as the study knows: a trial whose worker died counts the
    steps up to its last evaluation; one never started, none)."""
    if trial.state in (TrialState.RUNNING, TrialState.WAITING):
        return running
    attr = STEPS_ATTR if unit == "steps" else SAMPLES_ATTR
    if attr in trial.user_attrs:
        return int(trial.user_attrs[attr])
    steps = trial.last_step or 0
    return steps if unit == "steps" else steps * int(trial.user_attrs.get(PER_STEP_ATTR, 0))


def left(trials: list[FrozenTrial], budget: int, longest: int, unit: Unit = "steps") -> int:
    """What `budget` has left once each running trial is counted at `longest`."""
    return budget - sum(taken(t, longest, unit) for t in trials)


@dataclass(frozen=True)
class Limit:
    """One budget of a study: `total` of `unit`, of which one trial takes at most `largest`."""

    unit: Unit
    total: int
    largest: int

    def fits(self, trials: list[FrozenTrial]) -> bool:
        """Whether the largest trial still fits in what is left."""
        return left(trials, self.total, self.largest, self.unit) >= self.largest
