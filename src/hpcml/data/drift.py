"""Input drift profiles: fixed-bin histograms + a bounded reservoir sample per feature (compared
by `hpcml.data.drift_compare`; a live window of them in `hpcml.data.drift_window`).

Features: an image input (C, H, W) has one feature per channel (that channel's pixel values,
`values_per_row` of them drawn per image); any other input shape is flattened and has one
feature per element, the first `MAX_FEATURES` only (the profile records the cap). A feature
whose reference holds at most `MAX_CATEGORIES` distinct integer values is categorical: each
value is a bin of its own, plus one for values the reference never had.

Memory is bounded whatever the traffic: per feature a histogram of `len(edges) + 1` counts and
a reservoir of at most `reservoir` values (Vitter's algorithm R, seeded), plus a running count,
sum and sum of squares. A continuous feature's bins are cut at the reference's inner quantiles
(deciles by default; the first and last bins are open), so a current profile built against a
reference counts into the same bins. Profiles are JSON, never pickle.

The reservoir update is hand-written: a few numpy lines, and no kept library (scipy, numpy)
offers a vectorised reservoir.
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
PSI_THRESHOLD = 0.1
"""A feature has drifted when its PSI is over this (the usual rule of thumb: < 0.1 no change,
0.1-0.2 some, > 0.2 a significant shift) and its corrected chi-square p-value under `ALPHA`:
PSI alone grows with noise on small samples (the largest of 64 PSIs on 200 rows was over 0.2
in about half of undrifted trials), the test alone flags tiny shifts on large ones."""
ALPHA = 0.001
"""Family-wise false-alarm rate of one comparison (Bonferroni over the features)."""
MAX_CATEGORIES = 20
VALUES_PER_ROW = 64
"""Pixel values drawn per image and channel (seeded, with replacement): pixels of one image are
not independent, so more of them add cost more than information; the tests count rows."""
TOKEN_NOTE = (
    "the inputs are token ids: their values are names, not quantities, and their histogram "
    "mixes every position of the window, so drift found on them means little; watch the "
    "outputs (perplexity, lengths) instead."
)


def feature_names(input_shape: tuple[int, ...]) -> tuple[str, list[str]]:
    """('image', ['channel0', ...]) for (C, H, W); ('vector', ['x0', ...]) otherwise."""
    if len(input_shape) == 3:
        return "image", [f"channel{c}" for c in range(input_shape[0])]
    n = int(np.prod(input_shape)) if input_shape else 1
    return "vector", [f"x{i}" for i in range(min(n, MAX_FEATURES))]


def feature_values(
    x: np.ndarray,
    input_shape: tuple[int, ...],
    values_per_row: int | None = None,
    rng: np.random.Generator | None = None,
) -> list[np.ndarray]:
    """Per feature, the float64 values of a batch `x` of shape (N, *input_shape), as an
    (N, k) array: k = 1 for a vector element, an image channel's H*W pixels, or
    `values_per_row` of them drawn per image with `rng` where there are more."""
    x = np.asarray(x)
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise DataError(
            f"a batch of shape {tuple(x.shape)} does not match the profile's input shape "
            f"{tuple(input_shape)}; profile inputs of the same shape."
        )
    kind, names = feature_names(input_shape)
    if kind == "image":
        pixels = x.reshape(x.shape[0], x.shape[1], -1)
        hw = pixels.shape[2]
        if values_per_row is not None and values_per_row < hw:
            rng = rng if rng is not None else np.random.default_rng(0)
            at = rng.integers(0, hw, size=(x.shape[0], 1, values_per_row))
            pixels = np.take_along_axis(pixels, at, axis=2)
        return [pixels[:, c].astype(np.float64) for c in range(len(names))]
    flat = x.reshape(x.shape[0], -1)
    return [flat[:, i : i + 1].astype(np.float64) for i in range(len(names))]


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
    categorical: bool = False
    """`edges` are the reference's values, each its own bin; the last bin holds any other."""

    def bin_index(self, values: np.ndarray) -> np.ndarray:
        """The bin of each finite value."""
        n = len(self.edges)
        if self.categorical:
            pos = np.searchsorted(self.edges, values, side="left")
            hit = (pos < n) & (self.edges[np.minimum(pos, n - 1)] == values)
            return np.where(hit, pos, n)
        # searchsorted 'right' puts v == edges[0] in bin 1, v < edges[0] in bin 0 (underflow),
        # v >= edges[-1] in the last bin (overflow) except v == edges[-1], kept in the top bin.
        idx = np.searchsorted(self.edges, values, side="right")
        idx[values == self.edges[-1]] = n - 1
        return idx

    def update(self, values: np.ndarray, rng: np.random.Generator, capacity: int) -> None:
        values = values.reshape(-1)
        finite = np.isfinite(values)
        self.nonfinite += int(values.size - np.count_nonzero(finite))
        values = values[finite]
        if values.size == 0:
            return
        idx = self.bin_index(values)
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
            "categorical": self.categorical,
            "reservoir": self.reservoir.tolist(),
        }


@dataclass
class Profile:
    input_shape: tuple[int, ...]
    features: list[Feature]
    reservoir_size: int = RESERVOIR
    seed: int = 0
    rows: int = 0
    """Input rows profiled: the sample size of the tests (an image's pixels are one row)."""
    note: str | None = None
    """A caveat every comparison with this profile repeats (token ids: `TOKEN_NOTE`)."""
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def kind(self) -> str:
        return feature_names(self.input_shape)[0]

    @property
    def samples(self) -> int:
        return self.rows

    def update(self, x: np.ndarray, values_per_row: int | None = VALUES_PER_ROW) -> None:
        """Add a batch (N, *input_shape); an image adds `values_per_row` pixel values per
        channel (drawn, seeded), a vector one value per feature."""
        per_feature = feature_values(x, self.input_shape, values_per_row, self.rng)
        for feat, values in zip(self.features, per_feature, strict=True):
            feat.update(values, self.rng, self.reservoir_size)
        self.rows += int(np.asarray(x).shape[0])

    def empty_like(self, seed: int = 0) -> Profile:
        """A profile with this one's bins and no data (a live profile against a reference)."""
        feats = [
            Feature(f.name, f.edges.copy(), np.zeros_like(f.counts), np.empty(0),
                    categorical=f.categorical)
            for f in self.features
        ]  # fmt: skip
        return Profile(self.input_shape, feats, self.reservoir_size, seed, note=self.note)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kind": self.kind,
            "input_shape": list(self.input_shape),
            "max_features": MAX_FEATURES,
            "reservoir_size": self.reservoir_size,
            "seed": self.seed,
            "rows": self.rows,
            "note": self.note,
            "features": [f.to_json() for f in self.features],
        }

    def save(self, path: Path) -> Path:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()) + "\n")
        tmp.replace(path)
        return path


def _bins_of(name: str, values: np.ndarray, bins: int) -> Feature:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        finite = np.zeros(1)
    if np.array_equal(finite, np.round(finite)):  # integers: maybe a few categories
        distinct = np.unique(finite)
        if distinct.size <= MAX_CATEGORIES:
            return Feature(name, distinct, np.zeros(distinct.size + 1, np.int64), np.empty(0),
                           categorical=True)  # fmt: skip
    edges = np.unique(np.quantile(finite, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
    return Feature(name, edges, np.zeros(len(edges) + 1, np.int64), np.empty(0))


def profile_from_values(
    shape: tuple[int, ...],
    per_feature: list[np.ndarray],
    bins: int = BINS,
    reservoir: int = RESERVOIR,
    seed: int = 0,
    note: str | None = None,
) -> Profile:
    """A reference profile of per-feature (rows, k) values (`feature_values`)."""
    _, names = feature_names(shape)
    feats = [_bins_of(n, v.reshape(-1), bins) for n, v in zip(names, per_feature, strict=True)]
    profile = Profile(shape, feats, reservoir, seed, note=note)
    for feat, values in zip(feats, per_feature, strict=True):
        feat.update(values, profile.rng, reservoir)
    profile.rows = int(per_feature[0].shape[0]) if per_feature else 0
    return profile


def build_profile(
    x: np.ndarray,
    bins: int = BINS,
    reservoir: int = RESERVOIR,
    seed: int = 0,
    values_per_row: int | None = VALUES_PER_ROW,
) -> Profile:
    """A reference profile of a batch (N, *input_shape): bins at each feature's quantiles."""
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[0] == 0:
        raise DataError("a drift profile needs at least one sample; pass a non-empty batch.")
    shape = tuple(int(s) for s in x.shape[1:])
    rng = np.random.default_rng(seed)
    return profile_from_values(
        shape, feature_values(x, shape, values_per_row, rng), bins, reservoir, seed
    )


REFERENCE_FILE = "reference_profile.json"
REFERENCE_SAMPLES = 10_000
"""Default reference size (`data.drift_reference_samples`): with 10 bins, 10,000 rows keep the
reference's own sampling noise a tenth of a 1,000-row live window's."""


REFERENCE_ROWS_PER_SAMPLE = 4
"""A shard set's reference is drawn from whole shards chosen at random (seeded) until they hold
this many rows per reference sample (and at least REFERENCE_MIN_SHARDS shards, or all): reading
10,000 samples spread over every shard of a remote 10 TB set would fetch up to 10,000 whole
shards (640 GB at 64 MB) for a few MB of profile; this way it fetches a few dozen."""
REFERENCE_MIN_SHARDS = 32


def reference_indices(dataset: Any, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Which samples (sorted) the reference reads: `samples` drawn without replacement from the
    whole dataset, or, for a shard set (`counts`, `starts` per shard), from a seeded random
    choice of its shards (see REFERENCE_ROWS_PER_SAMPLE)."""
    n = len(dataset)
    counts, starts = getattr(dataset, "counts", None), getattr(dataset, "starts", None)
    if counts is None or starts is None or len(counts) <= REFERENCE_MIN_SHARDS:
        return np.sort(rng.choice(n, size=min(samples, n), replace=False))
    chosen: list[int] = []
    rows = 0
    for k in rng.permutation(len(counts)):
        if rows >= REFERENCE_ROWS_PER_SAMPLE * samples and len(chosen) >= REFERENCE_MIN_SHARDS:
            break
        chosen.append(int(k))
        rows += int(counts[k])
    pool = np.concatenate([np.arange(starts[k], starts[k] + counts[k]) for k in sorted(chosen)])
    return np.sort(rng.choice(pool, size=min(samples, len(pool)), replace=False))


def profile_dataset(
    dataset: Any,
    samples: int = REFERENCE_SAMPLES,
    seed: int = 0,
    prepare: Any = None,
    token_ids: bool = False,
) -> Profile:
    """A reference profile of `samples` inputs drawn without replacement (seeded) from a map-
    style dataset of (input, target) pairs: what training writes beside its export. `prepare`
    turns a stored input into the model's (a source's normalization left to the device).
    Inputs are read 256 at a time, and an image keeps `VALUES_PER_ROW` pixels per channel, so
    memory stays a few MB at the default size."""
    n = len(dataset)
    if n == 0:
        raise DataError("the training set is empty; a drift profile needs at least one sample.")
    rng = np.random.default_rng(seed)
    idx = reference_indices(dataset, samples, rng)
    first = (lambda v: v) if prepare is None else prepare
    parts: list[list[np.ndarray]] = []
    shape: tuple[int, ...] = ()
    for start in range(0, len(idx), 256):
        x = np.stack(
            [np.asarray(first(dataset[int(i)][0]), np.float64) for i in idx[start : start + 256]]
        )
        shape = tuple(int(s) for s in x.shape[1:])
        parts.append(feature_values(x, shape, VALUES_PER_ROW, rng))
    per_feature = [np.concatenate(p) for p in zip(*parts, strict=True)]
    note = TOKEN_NOTE if token_ids else None
    return profile_from_values(shape, per_feature, seed=seed, note=note)


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
                    bool(f.get("categorical", False)),
                )
            )
        shape = tuple(int(s) for s in doc["input_shape"])
        # Profiles written before `rows` counted every pixel of an image as a value.
        per_row = int(np.prod(shape[1:])) if len(shape) == 3 else 1
        rows = int(doc.get("rows", feats[0].seen // per_row if feats else 0))
        note = doc.get("note")
        return Profile(shape, feats, int(doc["reservoir_size"]), int(doc["seed"]), rows,
                       None if note is None else str(note))  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where} is not a valid drift profile ({e}).") from e
