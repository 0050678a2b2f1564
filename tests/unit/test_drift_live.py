"""The server's live drift profile without a server: what the request path keeps and what a
check folds in (bounded rows, bounded values), and the serve config's drift block."""

from __future__ import annotations

import numpy as np
import pytest

from hpcml.data.drift import build_profile
from hpcml.errors import ConfigError
from hpcml.serve.config import DriftConfig, build_serve_config
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.traffic.drift import DriftMonitor, Watched

SHAPE = (3, 8, 8)


def monitor(reference: bool, **cfg: object) -> tuple[DriftMonitor, Watched]:
    rng = np.random.default_rng(0)
    ref = build_profile(rng.normal(size=(1000, *SHAPE))) if reference else None
    m = DriftMonitor(DriftConfig.model_validate(cfg), ServeMetrics())
    w = m.watched[("m", "1")] = Watched("m", "1", ref)
    return m, w


def test_request_path_keeps_bounded_rows_and_check_folds_bounded_values() -> None:
    m, w = monitor(True, sample_rows=4, max_pending_rows=40, max_values_per_check=500)
    rng = np.random.default_rng(1)
    for _ in range(12):  # 12 requests of 16 rows: 4 kept from each, until 40 are pending
        request = rng.normal(size=(16, *SHAPE))
        m.observe("m", "1", request)
        if w.pending:  # kept rows are a copy: the request itself is not held
            assert not np.shares_memory(w.pending[-1], request)
    assert (w.pending_rows, w.dropped) == (40, 8)
    assert m.check(w) is None  # 40 rows < min_samples (200): no comparison yet
    assert w.rows == 40 and w.pending_rows == 0
    assert w.live is not None
    # 40 rows of 64 pixels a channel, capped at 500 values: 500 // 40 = 12 pixels of each row.
    assert [f.seen for f in w.live.profile().features] == [480, 480, 480]
    for _ in range(50):
        m.observe("m", "1", rng.normal(size=(4, *SHAPE)) + np.array([0.0, 0.0, 1.0])[:, None, None])
        if w.pending_rows == 40:
            m.check(w)
    result = m.check(w)
    assert result is not None and w.rows == 240
    # channel2 moved by one sigma in 200 of its 240 rows; channels 0 and 1 did not.
    assert result["drifted"] == ["channel2"]
    assert max(r["psi"] for r in result["features"][:2]) < 0.1


def test_without_a_reference_the_live_profile_takes_bins_from_its_first_rows() -> None:
    m, w = monitor(False, min_samples=1)
    m.observe("m", "1", np.random.default_rng(2).normal(size=(8, *SHAPE)))
    assert m.check(w) is None  # nothing to compare with
    doc = m.live_profile(w)
    assert doc is not None and doc["input_shape"] == list(SHAPE)
    assert doc["features"][0]["seen"] == 8 * 64
    m.observe("x", "1", np.zeros((8, *SHAPE)))  # a model not watched: ignored
    assert w.pending_rows == 0


def test_serve_config_drift_block_is_checked() -> None:
    cfg = build_serve_config({"drift": {"command": ["retrain", "--now"], "every_s": 5}})
    assert cfg.drift.command == ["retrain", "--now"] and cfg.drift.psi_threshold == 0.1
    with pytest.raises(ConfigError, match="drift.command"):
        build_serve_config({"drift": {"command": []}})
    with pytest.raises(ConfigError, match="window_rows .50. is under min_samples .200."):
        build_serve_config({"drift": {"window_rows": 50}})
    with pytest.raises(ConfigError, match="drift.shell"):
        build_serve_config({"drift": {"shell": "rm -rf /"}})
