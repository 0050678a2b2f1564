"""Input drift: feature profiles (fixed-bin histograms + a bounded reservoir sample per feature),
the population stability index (PSI) between two profiles, and scipy's two-sample KS test.

Features: an image input (C, H, W) has one feature per channel (that channel's pixel values);
any other input shape is flattened and has one feature per element, the first `MAX_FEATURES`
only (a wider input keeps its first 64 elements; the profile records the cap).

Memory is bounded whatever the traffic: per feature a histogram of `len(edges) + 1` counts and
a reservoir of at most `reservoir` values (Vitter's algorithm R, seeded), plus a running count,
sum and sum of squares. Bins are the reference's quantiles (deciles by default) with an
underflow and an overflow bin, so a current profile built against a reference counts into the
same bins. Profiles are JSON, never pickle.

PSI and the reservoir update are hand-written: each is a few numpy lines, and no kept library
(scipy, numpy) offers PSI or a vectorised reservoir; the KS test is scipy's `ks_2samp`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.errors import DataError

FORMAT = "hpcml-drift-profile/1"
MAX_FEATURES = 64
BINS = 10
RESERVOIR = 2048
PSI_FLOOR = 1e-4
"""A bin's share is floored at this before the log in PSI, so an empty bin gives a large but
finite term (the common convention; with 10 bins a 1e-4 floor keeps a single empty bin's
contribution of the same order as a real shift)."""
PSI_THRESHOLD = 0.2
"""The usual rule of thumb: PSI < 0.1 no change, 0.1-0.2 some, > 0.2 a significant shift."""


def feature_names(input_shape: tuple[int, ...]) -> tuple[str, list[str]]:
    """('image', ['channel0', ...]) for (C, H, W); ('vector', ['x0', ...]) otherwise."""
    if len(input_shape) == 3:
        return "image", [f"channel{c}" for c in range(input_shape[0])]
    n = int(np.prod(input_shape)) if input_shape else 1
    return "vector", [f"x{i}" for i in range(min(n, MAX_FEATURES))]


def feature_values(x: np.ndarray, input_shape: tuple[int, ...]) -> list[np.ndarray]:
    """Per feature, the 1-D float64 values of a batch `x` of shape (N, *input_shape)."""
    x = np.asarray(x)
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise DataError(
            f"a batch of shape {tuple(x.shape)} does not match the profile's input shape "
            f"{tuple(input_shape)}; profile inputs of the same shape."
        )
    kind, names = feature_names(input_shape)
    if kind == "image":
        return [x[:, c].reshape(-1).astype(np.float64) for c in range(len(names))]
    flat = x.reshape(x.shape[0], -1)
    return [flat[:, i].astype(np.float64) for i in range(len(names))]


@dataclass
class Feature:
    name: str
    edges: np.ndarray
    counts: np.ndarray
    reservoir: np.ndarray
    seen: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    nonfinite: int = 0
    """NaN and infinite values: counted in a bin of their own (PSI sees inputs turning NaN),
    kept out of the histogram, the moments and the reservoir."""

    def update(self, values: np.ndarray, rng: np.random.Generator, capacity: int) -> None:
        finite = np.isfinite(values)
        self.nonfinite += int(values.size - np.count_nonzero(finite))
        values = values[finite]
        if values.size == 0:
            return
        # searchsorted 'right' puts v == edges[0] in bin 1, v < edges[0] in bin 0 (underflow),
        # v >= edges[-1] in the last bin (overflow) except v == edges[-1], kept in the top bin.
        idx = np.searchsorted(self.edges, values, side="right")
        idx[values == self.edges[-1]] = len(self.edges) - 1
        self.counts += np.bincount(idx, minlength=len(self.edges) + 1).astype(np.int64)
        self.total += float(values.sum())
        self.total_sq += float(np.square(values).sum())
        self._reservoir(values, rng, capacity)
        self.seen += int(values.size)

    def _reservoir(self, values: np.ndarray, rng: np.random.Generator, capacity: int) -> None:
        room = max(0, capacity - self.reservoir.size)
        if room:
            self.reservoir = np.concatenate([self.reservoir, values[:room]])
        rest = values[room:]
        if rest.size == 0:
            return
        # Algorithm R: the value seen as number i (0-based) replaces slot j ~ U{0..i} if j < k.
        first = self.seen + room
        j = rng.integers(0, np.arange(first, first + rest.size) + 1)
        keep = j < capacity
        self.reservoir[j[keep]] = rest[keep]  # later values overwrite earlier ones, as in R

    @property
    def mean(self) -> float:
        return self.total / self.seen if self.seen else float("nan")

    @property
    def std(self) -> float:
        if not self.seen:
            return float("nan")
        return math.sqrt(max(0.0, self.total_sq / self.seen - self.mean**2))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "edges": self.edges.tolist(),
            "counts": self.counts.tolist(),
            "seen": self.seen,
            "mean": self.mean if self.seen else None,
            "std": self.std if self.seen else None,
            "sum": self.total,
            "sum_sq": self.total_sq,
            "nonfinite": self.nonfinite,
            "reservoir": self.reservoir.tolist(),
        }


@dataclass
class Profile:
    input_shape: tuple[int, ...]
    features: list[Feature]
    reservoir_size: int = RESERVOIR
    seed: int = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def kind(self) -> str:
        return feature_names(self.input_shape)[0]

    @property
    def samples(self) -> int:
        return self.features[0].seen if self.features else 0

    def update(self, x: np.ndarray, max_values: int | None = None) -> None:
        """Add a batch (N, *input_shape); with `max_values`, each feature adds at most that many
        of the batch's values, drawn uniformly (seeded, with replacement): a bounded cost."""
        for feat, values in zip(self.features, feature_values(x, self.input_shape), strict=True):
            if max_values is not None and values.size > max_values:
                values = values[self.rng.integers(0, values.size, max_values)]
            feat.update(values, self.rng, self.reservoir_size)

    def empty_like(self, seed: int = 0) -> Profile:
        """A profile with this one's bins and no data (a live profile against a reference)."""
        feats = [
            Feature(f.name, f.edges.copy(), np.zeros_like(f.counts), np.empty(0))
            for f in self.features
        ]
        return Profile(self.input_shape, feats, self.reservoir_size, seed)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kind": self.kind,
            "input_shape": list(self.input_shape),
            "max_features": MAX_FEATURES,
            "reservoir_size": self.reservoir_size,
            "seed": self.seed,
            "features": [f.to_json() for f in self.features],
        }

    def save(self, path: Path) -> Path:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()) + "\n")
        tmp.replace(path)
        return path


def build_profile(
    x: np.ndarray,
    bins: int = BINS,
    reservoir: int = RESERVOIR,
    seed: int = 0,
) -> Profile:
    """A reference profile of a batch (N, *input_shape): bins at each feature's quantiles."""
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[0] == 0:
        raise DataError("a drift profile needs at least one sample; pass a non-empty batch.")
    shape = tuple(int(s) for s in x.shape[1:])
    _, names = feature_names(shape)
    feats = []
    for name, values in zip(names, feature_values(x, shape), strict=True):
        finite = values[np.isfinite(values)]
        if finite.size == 0:
            finite = np.zeros(1)
        edges = np.unique(np.quantile(finite, np.linspace(0.0, 1.0, bins + 1)))
        feats.append(Feature(name, edges, np.zeros(len(edges) + 1, np.int64), np.empty(0)))
    profile = Profile(shape, feats, reservoir, seed)
    profile.update(x)
    return profile


REFERENCE_FILE = "reference_profile.json"
REFERENCE_SAMPLES = 512


def profile_dataset(
    dataset: Any, samples: int = REFERENCE_SAMPLES, seed: int = 0, prepare: Any = None
) -> Profile:
    """A reference profile of `samples` inputs drawn without replacement (seeded) from a map-
    style dataset of (input, target) pairs: what training writes beside its export. `prepare`
    turns a stored input into the model's (a source's normalization left to the device)."""
    n = len(dataset)
    if n == 0:
        raise DataError("the training set is empty; a drift profile needs at least one sample.")
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(n, size=min(samples, n), replace=False))
    first = (lambda v: v) if prepare is None else prepare
    x = np.stack([np.asarray(first(dataset[int(i)][0]), dtype=np.float64) for i in idx])
    return build_profile(x, seed=seed)


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"drift profile {p} does not exist; pass a reference_profile.json path.")
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{p} is not a drift profile (not JSON: {e}); pass a profile file.") from e
    return profile_from_json(doc, str(p))


def profile_from_json(doc: Any, where: str) -> Profile:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DataError(f"{where} is not a drift profile (format is not {FORMAT}).")
    try:
        feats = []
        for f in doc["features"]:
            edges = np.asarray(f["edges"], np.float64)
            counts = np.asarray(f["counts"], np.int64)
            if edges.ndim != 1 or edges.size == 0 or counts.shape != (edges.size + 1,):
                raise ValueError(f"feature {f.get('name')}: counts do not match the edges")
            feats.append(
                Feature(
                    str(f["name"]),
                    edges,
                    counts,
                    np.asarray(f["reservoir"], np.float64),
                    int(f["seen"]),
                    float(f["sum"]),
                    float(f["sum_sq"]),
                    int(f.get("nonfinite", 0)),
                )
            )
        shape = tuple(int(s) for s in doc["input_shape"])
        return Profile(shape, feats, int(doc["reservoir_size"]), int(doc["seed"]))
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where} is not a valid drift profile ({e}).") from e


def psi(expected: np.ndarray, actual: np.ndarray, floor: float = PSI_FLOOR) -> float:
    """Population stability index sum((a - e) * ln(a / e)) over bin shares, floored."""
    e = np.maximum(expected / max(expected.sum(), 1), floor)
    a = np.maximum(actual / max(actual.sum(), 1), floor)
    return float(np.sum((a - e) * np.log(a / e)))


def _finite(x: float) -> float | None:
    """A number for JSON: None where there is none (no samples), never NaN."""
    return x if math.isfinite(x) else None


def _counts_on(ref: Feature, cur: Feature) -> tuple[np.ndarray, str]:
    if cur.edges.shape == ref.edges.shape and np.array_equal(cur.edges, ref.edges):
        return cur.counts, "histogram"
    # Different bins (a profile built on its own data): re-bin its reservoir sample.
    tmp = Feature(cur.name, ref.edges, np.zeros_like(ref.counts), np.empty(0))
    tmp.update(cur.reservoir, np.random.default_rng(0), 0)
    return tmp.counts, "reservoir"


def compare(
    reference: Profile,
    current: Profile,
    psi_threshold: float = PSI_THRESHOLD,
    ks_alpha: float = 0.01,
) -> dict[str, Any]:
    """Per feature PSI (current against the reference's bins) and the KS test of the two
    reservoir samples. A feature has drifted when its PSI is over `psi_threshold`."""
    from scipy.stats import ks_2samp

    ref_names = [f.name for f in reference.features]
    cur_names = [f.name for f in current.features]
    if reference.input_shape != current.input_shape or ref_names != cur_names:
        raise DataError(
            f"the profiles describe different features (input shapes "
            f"{list(reference.input_shape)} and {list(current.input_shape)}); compare profiles "
            "of the same model input."
        )
    rows: list[dict[str, Any]] = []
    values: list[float] = []
    for ref, cur in zip(reference.features, current.features, strict=True):
        counts, binned = _counts_on(ref, cur)
        # The non-finite values as one more bin on both sides.
        value = (
            psi(np.append(ref.counts, ref.nonfinite), np.append(counts, cur.nonfinite))
            if (cur.seen or cur.nonfinite) and ref.seen
            else float("nan")
        )
        values.append(value)
        if ref.reservoir.size and cur.reservoir.size:
            ks = ks_2samp(ref.reservoir, cur.reservoir)
            stat, p = float(ks.statistic), float(ks.pvalue)
        else:
            stat, p = float("nan"), float("nan")
        rows.append(
            {
                "feature": ref.name,
                "psi": _finite(value),
                "drifted": bool(value > psi_threshold),
                "ks_statistic": _finite(stat),
                "ks_pvalue": _finite(p),
                "ks_reject": bool(p < ks_alpha),
                "reference_mean": _finite(ref.mean),
                "current_mean": _finite(cur.mean),
                "current_samples": cur.seen,
                "current_nonfinite": cur.nonfinite,
                "binned_from": binned,
            }
        )
    return {
        "psi_threshold": psi_threshold,
        "ks_alpha": ks_alpha,
        "features": rows,
        "drifted": [r["feature"] for r in rows if r["drifted"]],
        "max_psi": max((v for v in values if not math.isnan(v)), default=0.0),
    }
