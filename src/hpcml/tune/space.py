"""The search space of a study: `tune.space` checked against the config and turned into
Optuna distributions, and a trial's parameters turned back into `hpcml train` overrides.

Every key must be a key of the `RunConfig` tree and every edge of its range (or each choice)
a value that key accepts, so a bad space is refused before any trial starts.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from hpcml.config import TuneConfig, TuneParam, build_config
from hpcml.errors import ConfigError


def set_dotted(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of `data` with the dotted `key` set to `value` (sections created as needed)."""
    out = copy.deepcopy(data)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"tune.space key '{key}' goes inside '{part}', which holds a value, not a "
                "section; name a key of the config such as optim.lr."
            )
        node = child
    node[parts[-1]] = value
    return out


def _distribution(key: str, p: TuneParam) -> BaseDistribution:
    where = f"tune.space key '{key}'"
    if p.type == "categorical":
        if not p.choices:
            raise ConfigError(
                f"{where} is categorical but lists no choices; give `choices: [...]`."
            )
        if len(set(map(repr, p.choices))) != len(p.choices):
            raise ConfigError(f"{where} lists a choice twice; give each value once.")
        return CategoricalDistribution(p.choices)
    if p.low is None or p.high is None:
        raise ConfigError(f"{where} is {p.type} but lacks `low` or `high`; give both.")
    if p.choices is not None:
        raise ConfigError(f"{where} is {p.type} and also lists choices; use type: categorical.")
    if not p.low < p.high:
        raise ConfigError(
            f"{where} has an empty range (low {p.low} is not below high {p.high}); give low < high."
        )
    if p.log and p.low <= 0:
        raise ConfigError(f"{where} samples on a log scale but low is {p.low}; give low > 0.")
    if p.log and p.step is not None:
        raise ConfigError(f"{where} sets both log and step, which Optuna refuses; drop one.")
    if p.type == "float":
        return FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    if not all(float(v).is_integer() for v in (p.low, p.high, p.step or 1)):
        raise ConfigError(f"{where} is int but low, high or step is not whole; give integers.")
    step = int(p.step or 1)
    if (int(p.high) - int(p.low)) % step:
        raise ConfigError(f"{where}: high - low is not a multiple of step {step}; adjust them.")
    return IntDistribution(int(p.low), int(p.high), log=p.log, step=step)


def edge_values(dist: BaseDistribution) -> list[Any]:
    """The values a config must accept for the whole range to be usable."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    assert isinstance(dist, (FloatDistribution, IntDistribution))
    return [dist.low, dist.high]


def distributions(tune: TuneConfig, base: dict[str, Any]) -> dict[str, BaseDistribution]:
    """`tune.space` as Optuna distributions, each key and edge value checked against `base`
    (the config as a dict, overrides applied)."""
    if not tune.space:
        raise ConfigError(
            "tune.space is empty; map at least one config key to a distribution, e.g. "
            "optim.lr: {type: float, low: 1.0e-4, high: 1.0e-1, log: true}."
        )
    out: dict[str, BaseDistribution] = {}
    for key, param in tune.space.items():
        if key.split(".")[0] == "tune":
            raise ConfigError(f"tune.space key '{key}' is inside tune; search training keys only.")
        dist = _distribution(key, param)
        for value in edge_values(dist):
            build_config(set_dotted(base, key, value), origin=f"tune.space: {key}={value!r}")
        out[key] = dist
    return out


def grid(dists: dict[str, BaseDistribution]) -> dict[str, list[Any]]:
    """Every value of each dimension, for the grid sampler (ranges need a step)."""
    out: dict[str, list[Any]] = {}
    for key, d in dists.items():
        if isinstance(d, CategoricalDistribution):
            out[key] = list(d.choices)
        elif isinstance(d, IntDistribution) and not d.log:
            out[key] = list(range(d.low, d.high + 1, d.step))
        elif isinstance(d, FloatDistribution) and d.step is not None:
            n = round((d.high - d.low) / d.step)
            # Rounded: 0.1 * 3 is 0.30000000000000004, outside a range that ends at 0.3.
            out[key] = [min(d.high, round(d.low + i * d.step, 12)) for i in range(n + 1)]
        else:
            raise ConfigError(
                f"tune.sampler grid needs a finite set of values, but tune.space key '{key}' "
                "is a continuous or log range; give it a step or choices."
            )
    return out


def override(key: str, value: Any) -> str:
    """`key=value` that `hpcml train` parses back to the same value (YAML reads `1e-05` as a
    string; `yaml.safe_dump` writes `1.0e-05`)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    elif text.endswith("..."):
        text = text[: -len("...")].strip()
    return f"{key}={text}"


def overrides(params: dict[str, Any]) -> list[str]:
    return [override(k, v) for k, v in sorted(params.items())]


def suggest(trial: Any, dists: dict[str, BaseDistribution]) -> dict[str, Any]:
    """The trial's value of every dimension (sampled, or fixed for a queued retry)."""
    out: dict[str, Any] = {}
    for key, d in dists.items():
        if isinstance(d, CategoricalDistribution):
            out[key] = trial.suggest_categorical(key, d.choices)
        elif isinstance(d, IntDistribution):
            out[key] = trial.suggest_int(key, d.low, d.high, step=d.step, log=d.log)
        else:
            assert isinstance(d, FloatDistribution)
            out[key] = trial.suggest_float(key, d.low, d.high, step=d.step, log=d.log)
    return out
