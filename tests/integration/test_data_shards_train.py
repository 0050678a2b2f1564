"""`hpcml data shard digits` then `hpcml train data.source=shards`: the run reads the same
samples in the same order as training on `digits` itself (losses equal bit for bit, across a
resume that changes data.num_workers from 0 to 2), records the
shard set's version (summary.json, MLflow dataset input), and `data info --verify` names a
corrupted shard in one sentence with exit 2."""

from __future__ import annotations

import json

from tests.conftest import run_hpcml, step_losses, summary
from typer.testing import CliRunner

from hpcml.cli.app import app

CONFIG = "examples/digits_cnn.yaml"
COMMON = [
    "model.name=mlp",
    "model.args={hidden: 32}",
    "data.batch_size=16",
    "train.eval_every=0",
    "train.log_every=2",
    "train.max_steps=6",
    "optim.decay_steps=6",  # the split run keeps the 6-step schedule of the straight one
    "train.deterministic=true",
    "--quiet",
]


def test_training_on_shards_equals_training_on_the_source(tmp_path, tmp_path_factory):
    from mlflow import MlflowClient
    from tests.integration.mlflow_util import fresh_store

    store = fresh_store(tmp_path_factory, "shards-mlflow")
    shards_dir = tmp_path / "digits-shards"
    cli = CliRunner()
    made = cli.invoke(
        app,
        ["data", "shard", "digits", "--out", str(shards_dir), "--shard-size", "512KB", "--json"],
    )
    assert made.exit_code == 0, made.output
    info = json.loads(made.stdout)
    assert info["splits"]["train"]["shards"] > 1
    direct, sharded = tmp_path / "direct", tmp_path / "sharded"
    run_hpcml("train", CONFIG, *COMMON, "--run-dir", str(direct))
    on_shards = [
        *COMMON,
        "data.source=shards",
        f"data.path={shards_dir}",
        "tracking.backend=mlflow",
        f"tracking.uri={store}",
        "--run-dir",
        str(sharded),
    ]
    # 3 steps without loader workers, then a resume to step 6 with 2 workers: the saved loader
    # state is another worker count's, so the run continues from the global sample position.
    run_hpcml("train", CONFIG, *on_shards, "train.max_steps=3")
    run_hpcml("train", CONFIG, *on_shards, "data.num_workers=2", "--resume", "auto")
    # Same bytes, same (seed, epoch) order, same model init: the same losses exactly.
    assert step_losses(sharded) == step_losses(direct)
    assert sorted(step_losses(direct)) == list(range(1, 7))
    assert summary(sharded)["resumed_from"].endswith("step-3")
    s = summary(sharded)
    assert s["data"]["version"] == info["version"] and s["data"]["fingerprint"] == info["version"]
    assert s["data"]["train_samples"] == info["splits"]["train"]["samples"]
    assert summary(direct)["data"]["version"] is None
    # MLflow holds the shard set as the run's training dataset input.
    run_id = json.loads((sharded / "tracking.json").read_text())["run_id"]
    inputs = MlflowClient(tracking_uri=store).get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    assert inputs[0].dataset.digest == info["version"][:36]
    assert json.loads(inputs[0].dataset.source)["version"] == info["version"]
    assert [(t.key, t.value) for t in inputs[0].tags] == [("mlflow.data.context", "training")]

    listed = cli.invoke(app, ["data", "info", str(shards_dir), "--verify", "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["version"] == info["version"]

    victim = shards_dir / "train-00000.arrow"
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 0x01
    victim.write_bytes(bytes(raw))
    bad = cli.invoke(app, ["data", "info", str(shards_dir), "--verify"])
    assert bad.exit_code == 2
    assert "train-00000.arrow does not match the sha256" in bad.output
    assert "Traceback" not in bad.output
