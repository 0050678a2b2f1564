"""Comparing two drift profiles (`hpcml.data.drift`): per feature the population stability
index (PSI, the size of a shift) and Pearson's two-sample chi-square test of the bin counts
(whether a shift is more than sampling noise), Bonferroni-corrected over the features, with
scipy's KS statistic on the reservoirs reported beside them.

PSI and the chi-square statistic are computed for all features at once (a few numpy lines;
scipy's per-call overhead was most of a 64-feature check); the chi-square law's tail is scipy's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hpcml.data.drift import ALPHA, PSI_FLOOR, PSI_THRESHOLD, Feature, Profile
from hpcml.errors import DataError


def psi(expected: np.ndarray, actual: np.ndarray, floor: float = PSI_FLOOR) -> np.ndarray:
    """Population stability index sum((a - e) * ln(a / e)) over bin shares (last axis),
    floored: a float for 1-D counts, one per row for 2-D ones."""
    e = np.maximum(expected / np.maximum(expected.sum(axis=-1, keepdims=True), 1), floor)
    a = np.maximum(actual / np.maximum(actual.sum(axis=-1, keepdims=True), 1), floor)
    return np.sum((a - e) * np.log(a / e), axis=-1)


def chi2_homogeneity(
    expected: np.ndarray, actual: np.ndarray, n_expected: Any, n_actual: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Pearson's two-sample chi-square test that two histograms share one law, per row of
    (features, bins) counts: the statistic and p-value of scipy's `chi2_contingency(table,
    correction=False)` (a test checks them), each side's shares weighted by its number of rows
    rather than of values (an image's pixels are not independent; rows are the conservative
    sample size). Bins empty on both sides do not count; a row with fewer than two bins left,
    or an empty side, gives (0, 1)."""
    from scipy.special import chdtrc

    e_tot = expected.sum(axis=1, keepdims=True)
    a_tot = actual.sum(axis=1, keepdims=True)
    n_e = np.broadcast_to(np.asarray(n_expected, np.float64), (len(expected),))[:, None]
    n_a = np.broadcast_to(np.asarray(n_actual, np.float64), (len(actual),))[:, None]
    e = expected / np.maximum(e_tot, 1) * n_e
    a = actual / np.maximum(a_tot, 1) * n_a
    col = e + a
    keep = col > 0
    total = np.maximum(col.sum(axis=1, keepdims=True), 1e-300)
    stat = np.zeros(len(expected))
    for side, n in ((e, e.sum(axis=1, keepdims=True)), (a, a.sum(axis=1, keepdims=True))):
        fitted = np.where(keep, n * col / total, 1.0)
        stat += np.where(keep, (side - fitted) ** 2 / fitted, 0.0).sum(axis=1)
    df = keep.sum(axis=1) - 1
    ok = (df >= 1) & (e_tot[:, 0] > 0) & (a_tot[:, 0] > 0) & (n_e[:, 0] > 0) & (n_a[:, 0] > 0)
    stat = np.where(ok, stat, 0.0)
    return stat, np.where(ok, chdtrc(np.maximum(df, 1), stat), 1.0)


def _finite(x: float) -> float | None:
    """A number for JSON: None where there is none (no samples), never NaN."""
    return x if math.isfinite(x) else None


def _counts_on(ref: Feature, cur: Feature) -> tuple[np.ndarray, str]:
    if cur.edges.shape == ref.edges.shape and np.array_equal(cur.edges, ref.edges):
        return cur.counts, "histogram"
    # Different bins (a profile built on its own data): re-bin its reservoir sample.
    tmp = Feature(cur.name, ref.edges, np.zeros_like(ref.counts), np.empty(0),
                  categorical=ref.categorical)  # fmt: skip
    tmp.update(cur.reservoir, np.random.default_rng(0), 0)
    return tmp.counts, "reservoir"


def _ks(ref: Feature, cur: Feature, ks: bool) -> tuple[float, float]:
    """scipy's two-sample KS on the reservoirs (asymptotic p: the exact one cost 4 ms a
    feature); NaN for a categorical feature, where KS's continuous law does not hold."""
    from scipy.stats import ks_2samp

    if ks and ref.reservoir.size and cur.reservoir.size and not ref.categorical:
        res = ks_2samp(ref.reservoir, cur.reservoir, method="asymp")
        return float(res.statistic), float(res.pvalue)
    return float("nan"), float("nan")


def _tables(reference: Profile, current: Profile) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(features, bins + 1) counts of both sides on the reference's bins, the non-finite
    values as the last bin, padded with bins empty on both sides (which count for nothing)."""
    width = max(len(f.counts) for f in reference.features) + 1
    e = np.zeros((len(reference.features), width))
    a = np.zeros_like(e)
    binned = []
    for i, (ref, cur) in enumerate(zip(reference.features, current.features, strict=True)):
        counts, how = _counts_on(ref, cur)
        e[i, : len(ref.counts)], e[i, -1] = ref.counts, ref.nonfinite
        a[i, : len(counts)], a[i, -1] = counts, cur.nonfinite
        binned.append(how)
    return e, a, binned


def compare(
    reference: Profile,
    current: Profile,
    psi_threshold: float = PSI_THRESHOLD,
    ks_alpha: float = 0.01,
    alpha: float = ALPHA,
    ks: bool = True,
) -> dict[str, Any]:
    """Per feature PSI (current against the reference's bins), the chi-square test of the two
    histograms and (with `ks`) the KS test of the two reservoir samples, reported only. A
    feature has drifted when its PSI is over `psi_threshold` and its p-value, times the number
    of features (Bonferroni), is under `alpha`: at most `alpha` false alarms per comparison
    whatever the width."""
    ref_names = [f.name for f in reference.features]
    cur_names = [f.name for f in current.features]
    if reference.input_shape != current.input_shape or ref_names != cur_names or not ref_names:
        raise DataError(
            f"the profiles describe different features (input shapes "
            f"{list(reference.input_shape)} and {list(current.input_shape)}); compare profiles "
            "of the same model input."
        )
    e, a, binned = _tables(reference, current)
    n_cur = np.array(
        [min(current.rows, c.reservoir.size) if how == "reservoir" else current.rows
         for c, how in zip(current.features, binned, strict=True)]
    )  # fmt: skip  # a re-binned reservoir is the sample
    live = (e.sum(axis=1) > 0) & (a.sum(axis=1) > 0)
    values = np.where(live, psi(e, a), np.nan)
    stat, p = chi2_homogeneity(e, a, reference.rows, n_cur)
    p_corrected = np.minimum(1.0, p * len(ref_names))
    drifted = live & (values > psi_threshold) & (p_corrected < alpha)
    rows: list[dict[str, Any]] = []
    for i, (ref, cur) in enumerate(zip(reference.features, current.features, strict=True)):
        ks_stat, ks_p = _ks(ref, cur, ks)
        rows.append(
            {
                "feature": ref.name,
                "categorical": ref.categorical,
                "psi": _finite(float(values[i])),
                "chi2": float(stat[i]) if live[i] else None,
                "pvalue": float(p[i]) if live[i] else None,
                "pvalue_corrected": float(p_corrected[i]) if live[i] else None,
                "drifted": bool(drifted[i]),
                "ks_statistic": _finite(ks_stat),
                "ks_pvalue": _finite(ks_p),
                "ks_reject": bool(ks_p < ks_alpha),
                "reference_mean": _finite(ref.mean),
                "current_mean": _finite(cur.mean),
                "current_samples": cur.seen,
                "current_nonfinite": cur.nonfinite,
                "binned_from": binned[i],
            }
        )
    return {
        "psi_threshold": psi_threshold,
        "alpha": alpha,
        "correction": "bonferroni",
        "ks_alpha": ks_alpha,
        "reference_rows": reference.rows,
        "current_rows": current.rows,
        "warning": reference.note or current.note,
        "features": rows,
        "drifted": [r["feature"] for r in rows if r["drifted"]],
        "max_psi": float(np.nanmax(values)) if live.any() else 0.0,
    }
