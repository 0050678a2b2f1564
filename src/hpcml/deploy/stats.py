"""Is the candidate better than the model it would replace, on the same held-out samples?

Both models score every sample of one set, so the comparison is paired: the per-sample
differences carry the evidence, and the variation between samples that both models find easy
or hard cancels out. Two tests:

- a paired bootstrap of the metric's gain (resample the samples with replacement, both
  models' scores together; Koehn 2004): the gain's one-sided lower confidence bound must clear
  the minimum gain;
- for accuracy, McNemar's exact test (the binomial test on the discordant pairs: samples one
  model gets right and the other wrong; McNemar 1947, exact form as in statsmodels'
  `mcnemar(exact=True)`), one-sided: the candidate must win significantly more of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import binomtest

BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class PairedResult:
    metric: str
    samples: int
    candidate: float
    incumbent: float
    gain: float
    """Candidate minus incumbent, signed so that positive is better (loss: incumbent minus)."""
    ci_low: float
    ci_high: float
    confidence: float
    min_gain: float
    p_value: float | None
    """McNemar's one-sided exact p (accuracy only)."""
    candidate_only: int | None
    """Samples only the candidate gets right (accuracy)."""
    incumbent_only: int | None
    better: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mcnemar_greater(candidate_only: int, incumbent_only: int) -> float:
    """One-sided exact McNemar p: the chance of the candidate winning at least this many of the
    discordant pairs if either model were as likely to win each."""
    n = candidate_only + incumbent_only
    if n == 0:
        return 1.0
    return float(binomtest(candidate_only, n, 0.5, alternative="greater").pvalue)


def paired_bootstrap(
    diff: np.ndarray, confidence: float, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the mean of per-sample differences: the lower end is one-sided at
    `confidence`, and the upper end mirrors it."""
    rng = np.random.default_rng(seed)
    n = len(diff)
    rows = max(1, 2_000_000 // n)  # ~16 MB of indices at a time, whatever the set's size
    means = np.concatenate(
        [
            diff[rng.integers(0, n, size=(min(rows, resamples - start), n))].mean(axis=1)
            for start in range(0, resamples, rows)
        ]
    )
    alpha = 1.0 - confidence
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


def compare(
    metric: str,
    candidate: np.ndarray,
    incumbent: np.ndarray,
    confidence: float = 0.95,
    min_gain: float = 0.0,
    seed: int = 0,
) -> PairedResult:
    """`candidate`/`incumbent`: per-sample scores on the same samples in the same order:
    0/1 correctness for accuracy, per-sample loss for a loss."""
    cand = np.asarray(candidate, dtype=np.float64)
    inc = np.asarray(incumbent, dtype=np.float64)
    if cand.shape != inc.shape or cand.ndim != 1 or len(cand) == 0:
        raise ValueError("paired scores need two equally long, non-empty 1-d arrays")
    lower_is_better = metric == "loss"
    diff = inc - cand if lower_is_better else cand - inc
    gain = float(diff.mean())
    low, high = paired_bootstrap(diff, confidence, seed=seed)
    p = c_only = i_only = None
    if metric == "accuracy" and np.isin(cand, (0.0, 1.0)).all() and np.isin(inc, (0.0, 1.0)).all():
        c_only = int(((cand > 0.5) & (inc < 0.5)).sum())
        i_only = int(((cand < 0.5) & (inc > 0.5)).sum())
        p = mcnemar_greater(c_only, i_only)
    alpha = 1.0 - confidence
    checks = [low > min_gain]
    if p is not None:
        checks.append(p < alpha)
    better = all(checks)
    pct = f"{confidence:.0%}"
    reason = (
        f"{metric} gain {gain:+.4g} (paired bootstrap {pct} lower bound {low:+.4g}"
        + (f"; McNemar p={p:.3g}, {c_only} vs {i_only} discordant" if p is not None else "")
        + ")"
        + (
            f" clears the minimum gain {min_gain:g}"
            if better
            else f" does not show a gain above {min_gain:g} at {pct} confidence"
        )
    )
    return PairedResult(
        metric, len(cand), float(cand.mean()), float(inc.mean()), gain, low, high, confidence,
        min_gain, p, c_only, i_only, better, reason,
    )  # fmt: skip
