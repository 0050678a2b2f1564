"""A live drift profile that forgets: the last `rows` input rows, binned on a reference's bins.

Why: a profile that counts every row since the server started needs as many shifted rows as it
has seen normal ones before a shift shows (75,000 after 100,000); the tests of
`hpcml.data.drift.compare` also need a sample size that does not grow without bound, or they
flag shifts too small to matter. A window keeps both fixed.

Each row's per-feature histogram (plus a non-finite slot), value count, sum and sum of squares
sit in a ring of `rows` slots, so the window's histogram is exact, whatever the size of the
batches folded in. Memory: rows x features x (bins + 2) x 4 bytes (1,000 x 64 x 12 x 4 = 3 MB)
plus the last `Profile.reservoir_size` values per feature (the reservoir of the window's
profile, for the KS statistic and for re-binning).
"""

from __future__ import annotations

import numpy as np

from hpcml.data.drift import Feature, Profile, feature_values


class LiveWindow:
    def __init__(self, bins: Profile, rows: int, seed: int = 1) -> None:
        self.bins = bins
        self.size = int(rows)
        feats = bins.features
        self.nbins = [len(f.edges) + 1 for f in feats]
        self.slots = max(self.nbins, default=1) + 1  # the last slot: non-finite values
        self.hist = np.zeros((self.size, len(feats), self.slots), np.int32)
        self.sums = np.zeros((self.size, len(feats)))
        self.sumsq = np.zeros((self.size, len(feats)))
        self.finite = np.zeros((self.size, len(feats)), np.int64)
        self.recent = np.full((len(feats), bins.reservoir_size), np.nan)
        self.recent_pos = 0
        self.pos = 0
        self.filled = 0
        self.seen = 0
        self.rng = np.random.default_rng(seed)

    def add(self, x: np.ndarray, values_per_row: int | None) -> None:
        """Fold a batch (N, *input_shape) in; only its last `rows` rows can stay."""
        x = np.asarray(x)
        self.seen += len(x)
        x = x[-self.size :]
        n = len(x)
        if n == 0:
            return
        per_feature = feature_values(x, self.bins.input_shape, values_per_row, self.rng)
        hist = np.zeros((n, len(per_feature), self.slots), np.int32)
        offsets = self.slots * np.arange(n)[:, None]
        for f, (feat, v) in enumerate(zip(self.bins.features, per_feature, strict=True)):
            ok = np.isfinite(v)
            idx = np.full(v.shape, self.slots - 1)
            idx[ok] = feat.bin_index(v[ok])
            hist[:, f] = np.bincount((idx + offsets).ravel(), minlength=n * self.slots).reshape(
                n, self.slots
            )
            clean = np.where(ok, v, 0.0)
            at = (self.pos + np.arange(n)) % self.size
            self.sums[at, f] = clean.sum(axis=1)
            self.sumsq[at, f] = np.square(clean).sum(axis=1)
            self.finite[at, f] = ok.sum(axis=1)
        self.hist[(self.pos + np.arange(n)) % self.size] = hist
        self.pos = (self.pos + n) % self.size
        self.filled = min(self.size, self.filled + n)
        self._remember(np.stack([v.reshape(-1) for v in per_feature]))

    def _remember(self, values: np.ndarray) -> None:
        cap = self.recent.shape[1]
        values = values[:, -cap:]
        at = (self.recent_pos + np.arange(values.shape[1])) % cap
        self.recent[:, at] = values
        self.recent_pos = (self.recent_pos + values.shape[1]) % cap

    def profile(self) -> Profile:
        """The window as a profile (what the server compares and `?profile=1` returns)."""
        counts = self.hist[: self.filled].sum(axis=0, dtype=np.int64)
        feats = []
        for f, ref in enumerate(self.bins.features):
            recent = self.recent[f]
            feats.append(
                Feature(
                    ref.name,
                    ref.edges.copy(),
                    counts[f, : self.nbins[f]].copy(),
                    recent[np.isfinite(recent)],
                    int(self.finite[: self.filled, f].sum()),
                    float(self.sums[: self.filled, f].sum()),
                    float(self.sumsq[: self.filled, f].sum()),
                    int(counts[f, self.slots - 1]),
                    ref.categorical,
                )
            )
        b = self.bins
        return Profile(b.input_shape, feats, b.reservoir_size, 1, self.filled, b.note)
