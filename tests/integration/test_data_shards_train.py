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


def test_a_resume_onto_another_shard_set_version_is_refused_unless_allowed(
    tmp_path, tmp_path_factory
):
    """Issue 30: resuming onto a shard set of another version went on silently (rc 0), and the
    export named the path but not the version. Refused now in one sentence, exit 2, the run
    folder untouched; with --allow-data-change the run goes on and records both versions, in
    order, in summary.json, model.json, the registry entry and MLflow's dataset inputs (the
    source type and absolute location of each)."""
    from mlflow import MlflowClient
    from tests.integration.mlflow_util import fresh_store

    from hpcml.track.registry import register_run

    store = fresh_store(tmp_path_factory, "shards-versions")
    cli = CliRunner()
    versions = []
    for name, size in (("a", "512KB"), ("b", "256KB")):  # same samples, other shards: 2 versions
        made = cli.invoke(
            app, ["data", "shard", "digits", "--out", str(tmp_path / name), "--shard-size", size,
                  "--json"],
        )  # fmt: skip
        assert made.exit_code == 0, made.output
        versions.append(json.loads(made.stdout)["version"])
    va, vb = versions
    assert va != vb
    run = tmp_path / "run"
    args = [*COMMON, "data.source=shards", "--run-dir", str(run)]
    run_hpcml("train", CONFIG, *args, f"data.path={tmp_path / 'a'}", "train.max_steps=2")
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    resume = [*args, f"data.path={tmp_path / 'b'}", "train.max_steps=4", "--resume", "auto"]
    refused = run_hpcml("train", CONFIG, *resume, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--allow-data-change" in lines[0], lines
    assert f"shard set {va[:16]}" in lines[0] and f"shard set {vb[:16]}" in lines[0]
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before

    run_hpcml("train", CONFIG, *resume, "--allow-data-change")
    read = [{"version": va, "path": str(tmp_path / "a")}, {"version": vb, "path": str(tmp_path / "b")}]
    s = summary(run)
    assert s["data"]["version"] == vb and s["data"]["versions_read"] == read
    meta = json.loads((run / "export" / "model.json").read_text())["metadata"]
    assert (meta["data_version"], meta["data_versions_read"]) == (vb, read)
    # Registering the (untracked) run logs it to MLflow with its dataset inputs.
    entry = register_run(run, "versions-model", tracking_uri=store)
    client = MlflowClient(tracking_uri=store)
    run_id = client.get_model_version("versions-model", str(entry["version"])).run_id
    inputs = client.get_run(run_id).inputs.dataset_inputs
    got = sorted((i.dataset.digest, i.dataset.source_type, json.loads(i.dataset.source)["uri"])
                 for i in inputs)  # fmt: skip
    assert got == sorted(
        [(va[:36], "local", str((tmp_path / "a").resolve())),
         (vb[:36], "local", str((tmp_path / "b").resolve()))]
    )  # fmt: skip
    tags = client.get_model_version("versions-model", str(entry["version"])).tags
    assert tags["data_version"] == vb and tags["data_versions_read"] == f"{va},{vb}"
