"""How far a study may go: where its pruners' first rung is (`tune.first_rung`) and how many
training steps its trials may take in all (`tune.step_budget`).

The first rung defaults to the first evaluation after the longest learning-rate warmup the
space allows: during its warmup a trial trains at a fraction of its learning rate, so a longer
warmup looks worse at an early evaluation for no reason that lasts, and a pruner judging there
stops the trials that would have been best at the end.

The step budget is a hard cap: a trial starts only if a run of its full length fits in what
the study has left, counting each finished trial's steps as it ran them (a pruned trial's
fewer) and each running one at full length.
"""

from __future__ import annotations

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


def largest(dists: dict[str, BaseDistribution], key: str, default: int) -> int:
    """The largest value the space gives `key` (an int setting), or `default` when the space
    does not search it."""
    d = dists.get(key)
    if d is None:
        return default
    if isinstance(d, CategoricalDistribution):
        return int(max(v for v in d.choices if isinstance(v, int | float)))
    assert isinstance(d, FloatDistribution | IntDistribution)
    return int(d.high)


def trial_steps(cfg: RunConfig, dists: dict[str, BaseDistribution]) -> int:
    """The most steps one trial can train."""
    return largest(dists, "train.max_steps", cfg.train.max_steps)


def first_rung(tune: TuneConfig, cfg: RunConfig, dists: dict[str, BaseDistribution]) -> int:
    """The step of the pruners' first rung (see the module docstring)."""
    if tune.first_rung is not None:
        return tune.first_rung
    every = cfg.train.eval_every or cfg.train.max_steps
    warmup = largest(dists, "optim.warmup_steps", cfg.optim.warmup_steps)
    return min((warmup // every + 1) * every, trial_steps(cfg, dists))


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


def steps_taken(trial: FrozenTrial, running: int) -> int:
    """What `trial` counts against the budget: `running` while it runs or waits to, else the
    steps its run took (as far as the study knows: a trial whose worker died counts up to its
    last evaluation; one never started, none)."""
    if trial.state in (TrialState.RUNNING, TrialState.WAITING):
        return running
    if STEPS_ATTR in trial.user_attrs:
        return int(trial.user_attrs[STEPS_ATTR])
    return trial.last_step or 0


def left(trials: list[FrozenTrial], budget: int, longest: int) -> int:
    """Steps `budget` has left once each running trial is counted at `longest` steps."""
    return budget - sum(steps_taken(t, longest) for t in trials)
