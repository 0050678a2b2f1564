"""Drift end to end: `hpcml train` writes a reference profile beside its export; `hpcml serve`
(real uvicorn on loopback, httpx) watches its inputs against it, exports the PSI gauge and runs
the operator's command once when the threshold is crossed."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tests.conftest import run_hpcml
from typer.testing import CliRunner

from hpcml.cli.app import app as cli_app
from hpcml.config import DataConfig
from hpcml.data.sources import load_source
from hpcml.serve.codec.oip import encode_request
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

CONFIG = "examples/digits_cnn.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("drift") / "run"
    run_hpcml(
        "train", CONFIG, "model.name=mlp", "model.args.hidden=16", "model.args.depth=1",
        "data.batch_size=16", "train.max_steps=2", "train.eval_every=0",
        "train.checkpoint_every=0", "--run-dir", str(run), "--quiet",
    )  # fmt: skip
    return run


@pytest.fixture(scope="module")
def train_x() -> np.ndarray:
    splits = load_source(DataConfig(source="digits", val_fraction=0.2))
    return np.stack([np.asarray(splits.train[i][0]) for i in range(len(splits.train))])


def test_training_writes_a_reference_profile_of_its_inputs(
    run_dir: Path, train_x: np.ndarray
) -> None:
    doc = json.loads((run_dir / "export" / "reference_profile.json").read_text())
    assert doc["input_shape"] == [3, 32, 32]
    feats = doc["features"]
    assert [f["name"] for f in feats] == ["channel0", "channel1", "channel2"]
    n, per_image = len(train_x), 64
    assert n < 10_000 and doc["rows"] == n  # the default reference size takes every image
    for c, f in enumerate(feats):
        assert f["seen"] == n * per_image  # 64 pixels drawn from each image and channel
        assert len(f["reservoir"]) == 2048
        pixels = train_x[:, c].reshape(n, -1)
        # The profile's mean is that of 64 pixels drawn (with replacement) from each of the n
        # images: its variance is mean(within-image variance) / (64 n); 4 standard errors.
        bound = 4 * np.sqrt(pixels.var(axis=1).mean() / (per_image * n))
        assert abs(f["mean"] - pixels.mean()) < bound, (c, f["mean"], bound)


def _gauges(text: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def _wait(c: httpx.Client, until: object, what: str) -> dict:
    deadline = time.monotonic() + 60  # a bound on a hung server, not a speed assertion
    while time.monotonic() < deadline:
        state = c.get("/v2/models/digits/drift").json()
        if until(state):  # type: ignore[operator]
            return state
        time.sleep(0.05)
    raise AssertionError(f"{what}: {state}")


def test_serve_watches_inputs_and_runs_the_command_once(
    run_dir: Path, train_x: np.ndarray, tmp_path: Path
) -> None:
    marker = tmp_path / "ran.txt"
    script = tmp_path / "retrain.py"
    script.write_text(
        "import os, sys\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(' '.join(os.environ[k] for k in "
        "('HPCML_MODEL', 'HPCML_VERSION', 'HPCML_PSI')) + '\\n')\n"
    )
    cfg = ServeConfig.model_validate(
        {
            "defaults": {"isolation": "thread"},
            "drift": {
                "psi_threshold": 0.2,
                "min_samples": 64,
                "every_s": 0.2,
                "max_values_per_check": 10**8,  # every value: counts independent of timing
                "command": [sys.executable, str(script), str(marker)],
            },
        }
    )
    rng = np.random.default_rng(0)
    with (
        running_server(build_app(run_dir, cfg, name="digits")) as url,
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        for _ in range(16):  # 128 unshifted rows: training images
            x = train_x[rng.choice(len(train_x), 8, replace=False)].astype(np.float32)
            assert c.post("/v2/models/digits/infer", json=encode_request(x)).status_code == 200
        state = _wait(c, lambda s: s["comparison"] is not None and s["rows"] == 128, "no check")
        assert state["reference"] and state["comparison"]["max_psi"] < 0.2
        assert not state["over_threshold"]
        psi = _gauges(c.get("/metrics").text, "hpcml_input_drift_psi")
        assert len(psi) == 3 and max(psi.values()) < 0.2
        for _ in range(48):  # 384 rows shifted by +1 (half the [-1, 1] pixel range)
            x = train_x[rng.choice(len(train_x), 8, replace=False)].astype(np.float32) + 1.0
            assert c.post("/v2/models/digits/infer", json=encode_request(x)).status_code == 200
        state = _wait(c, lambda s: s["over_threshold"], "never over the threshold")
        assert state["comparison"]["drifted"] == ["channel0", "channel1", "channel2"]
        deadline = time.monotonic() + 30  # a bound on a hung command, not a speed assertion
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        checks = state["checks"]
        _wait(c, lambda s: s["checks"] >= checks + 5, "checks stopped")  # 5 more, still over
        lines = marker.read_text().splitlines()
        assert len(lines) == 1, lines
        model, version, value = lines[0].split()
        assert (model, version) == ("digits", "1") and float(value) > 0.2
        metrics = c.get("/metrics").text
        assert max(_gauges(metrics, "hpcml_input_drift_psi").values()) > 0.2
        crossings = _gauges(metrics, "hpcml_input_drift_crossings_total")
        assert crossings == {'model="digits",version="1"': 1.0}
        live = c.get("/v2/models/digits/drift", params={"profile": 1})
        (tmp_path / "live.json").write_text(live.text)
    verdict = CliRunner().invoke(
        cli_app,
        [
            "data", "drift", str(run_dir / "export" / "reference_profile.json"),
            str(tmp_path / "live.json"), "--json",
        ],
    )  # fmt: skip
    assert verdict.exit_code == 1, verdict.output
    assert json.loads(verdict.output)["features"][0]["current_samples"] == 512 * 32 * 32
