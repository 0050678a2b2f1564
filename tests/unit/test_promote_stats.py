"""The paired test `hpcml promote` decides with: McNemar's exact one-sided p and the paired
bootstrap's lower bound, on seeded per-sample scores."""

from __future__ import annotations

import numpy as np
import pytest

from hpcml.deploy.stats import compare, mcnemar_greater


def test_mcnemar_is_the_binomial_tail_of_the_discordant_pairs() -> None:
    # 10 of 12 discordant pairs won: P(X >= 10 | n=12, 1/2) = (66 + 12 + 1) / 4096.
    assert mcnemar_greater(10, 2) == pytest.approx(79 / 4096, rel=1e-12)
    assert mcnemar_greater(0, 0) == 1.0
    assert mcnemar_greater(2, 10) > 0.99


def scores(n: int, p: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < p).astype(float)


def test_a_clearly_better_candidate_is_better() -> None:
    inc = scores(400, 0.80, 1)
    cand = inc.copy()
    flip = np.flatnonzero(inc == 0)[:40]  # the candidate also gets 40 of the misses right
    cand[flip] = 1.0
    r = compare("accuracy", cand, inc, confidence=0.95, min_gain=0.0)
    assert r.better and r.candidate_only == 40 and r.incumbent_only == 0
    assert r.gain == pytest.approx(0.1)
    assert r.ci_low > 0.05 and r.p_value < 1e-10


def test_the_same_model_is_not_better() -> None:
    inc = scores(400, 0.9, 2)
    r = compare("accuracy", inc, inc.copy())
    assert not r.better and r.gain == 0.0 and r.p_value == 1.0


def test_a_small_gain_on_few_samples_is_not_enough() -> None:
    """3 more right out of 60 (5 points) is within chance: the bootstrap's lower bound is below 0."""
    inc = scores(60, 0.7, 3)
    cand = inc.copy()
    cand[np.flatnonzero(inc == 0)[:4]] = 1.0
    cand[np.flatnonzero(inc == 1)[:1]] = 0.0
    r = compare("accuracy", cand, inc, confidence=0.95)
    assert r.gain > 0 and not r.better
    assert r.p_value > 0.05


def test_min_gain_is_a_bar_the_lower_bound_must_clear() -> None:
    inc = scores(1000, 0.8, 4)
    cand = inc.copy()
    cand[np.flatnonzero(inc == 0)[:30]] = 1.0  # +3 points, clearly real
    assert compare("accuracy", cand, inc, min_gain=0.0).better
    assert not compare("accuracy", cand, inc, min_gain=0.05).better


def test_loss_is_better_when_lower() -> None:
    rng = np.random.default_rng(5)
    inc = rng.gamma(2.0, 0.5, 300)
    cand = inc * 0.8  # 20% lower loss on every sample
    r = compare("loss", cand, inc)
    assert r.better and r.gain > 0 and r.p_value is None
    assert not compare("loss", inc, cand).better
