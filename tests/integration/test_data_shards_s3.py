"""A shard set in an S3-compatible bucket: `data.path: s3://BUCKET/PREFIX?endpoint_override=...`.

The bucket is served on loopback by moto's standalone server, which speaks the S3 REST API
over HTTP (no MinIO or Ceph gateway is packaged for this machine); hpcml reads it with
pyarrow's own S3 client, credentials from the environment. The checks:

- `hpcml data info s3://... --verify` reads the manifest and hashes every shard: the same
  version id as the local folder it was uploaded from;
- `hpcml train` on the bucket, 2 gloo processes with 2 loader workers each (every worker opens
  its own client), gives the same losses bit for bit as training on the local folder;
- a shard object replaced by one with a flipped byte (same size, so only the sha256 tells) is
  refused when it is read, in one sentence, exit 2; credentials in the URL are refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import moto.server as moto_server  # the dev extra's moto[server]: missing fails, never skips
import pyarrow.fs as pafs
import pytest
from tests.conftest import hpcml_env, run_hpcml, step_losses
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.data.shards import read_manifest, version_id

CONFIG = "examples/digits_cnn.yaml"
COMMON = [
    "model.name=mlp",
    "model.args={hidden: 32}",
    "data.batch_size=16",
    "train.eval_every=0",
    "train.log_every=2",
    "train.max_steps=4",
    "train.checkpoint_every=0",
    "train.deterministic=true",
    "--quiet",
]
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "hpcml-test",
    "AWS_SECRET_ACCESS_KEY": "hpcml-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never ask an instance-metadata service for credentials from a test.
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, object]]:
    """A digits shard set written locally and uploaded to s3://hpcml/digits."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        local = tmp_path_factory.mktemp("s3") / "digits-shards"
        made = CliRunner().invoke(
            app, ["data", "shard", "digits", "--out", str(local), "--shard-size", "512KB"]
        )
        assert made.exit_code == 0, made.output
        fs = pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}",
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        fs.create_dir("hpcml")
        for f in sorted(local.iterdir()):
            with fs.open_output_stream(f"hpcml/digits/{f.name}") as out:
                out.write(f.read_bytes())
        url = f"s3://hpcml/digits?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        yield local, url, fs
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_info_reads_and_verifies_the_bucket(bucket: tuple[Path, str, object]) -> None:
    local, url, _ = bucket
    cli = CliRunner()
    here = cli.invoke(app, ["data", "info", str(local), "--json"])
    there = cli.invoke(app, ["data", "info", url, "--verify", "--json"])
    assert there.exit_code == 0, there.output
    assert json.loads(there.stdout)["version"] == json.loads(here.stdout)["version"]
    assert json.loads(there.stdout)["verified"] is True


def test_training_from_the_bucket_equals_training_from_the_folder(
    bucket: tuple[Path, str, object], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from mlflow import MlflowClient
    from tests.integration.mlflow_util import fresh_store

    local, url, _ = bucket
    env = {**hpcml_env(), **CREDENTIALS}
    on_disk, in_bucket = tmp_path / "disk", tmp_path / "bucket"
    store = fresh_store(tmp_path_factory, "s3-mlflow")
    # One order for both: by default a bucket mixes data.shard_cache - 1 shards at a time and
    # a local folder all of them (tests/integration/test_data_shards_shuffle.py).
    shards = [
        "data.source=shards", "data.num_workers=2", "data.shuffle_shards=3",
        "tracking.backend=mlflow", f"tracking.uri={store}",
    ]  # fmt: skip
    run_hpcml(
        "train", CONFIG, *COMMON, *shards, f"data.path={local}", "--nproc", "2",
        "--run-dir", str(on_disk), env=env,
    )
    run_hpcml(
        "train", CONFIG, *COMMON, *shards, f"data.path={url}", "--nproc", "2",
        "--run-dir", str(in_bucket), env=env,
    )
    assert sorted(step_losses(in_bucket)) == [1, 2, 3, 4]
    assert step_losses(in_bucket) == step_losses(on_disk)
    # The run records the shard set's version, the same wherever the bytes came from.
    version = version_id(read_manifest(local))
    assert json.loads((in_bucket / "summary.json").read_text())["data"]["version"] == version
    # MLflow's dataset input names where each run read it, with MLflow's source type for it
    # (issue 30: a bucket was recorded as source_type "local").
    client = MlflowClient(tracking_uri=store)
    for run_dir, source_type, uri in (
        (in_bucket, "s3", "s3://hpcml/digits"),
        (on_disk, "local", str(local.resolve())),
    ):
        run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
        (given,) = client.get_run(run_id).inputs.dataset_inputs
        assert given.dataset.digest == version[:36]
        assert (given.dataset.source_type, json.loads(given.dataset.source)["uri"]) == (
            source_type,
            uri,
        )


def test_a_replaced_shard_object_is_refused_when_read(
    bucket: tuple[Path, str, object], tmp_path: Path
) -> None:
    local, url, fs = bucket
    name = "train-00000.arrow"
    raw = bytearray((local / name).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    key = f"hpcml/digits/{name}"
    with fs.open_output_stream(key) as out:  # type: ignore[attr-defined]
        out.write(bytes(raw))
    try:
        env = {**hpcml_env(), **CREDENTIALS}
        proc = run_hpcml(
            "train", CONFIG, *COMMON, "data.source=shards", f"data.path={url}",
            "--run-dir", str(tmp_path / "run"), env=env, check=False,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "does not match the sha256" in proc.stderr and "Traceback" not in proc.stderr
        assert name in proc.stderr
    finally:
        with fs.open_output_stream(key) as out:  # type: ignore[attr-defined]
            out.write((local / name).read_bytes())
    secret = url.replace("s3://", "s3://user:pass@")
    res = CliRunner().invoke(app, ["data", "info", secret])
    assert res.exit_code == 2 and "credentials in the URL" in res.stderr
    assert "pass" not in res.stderr
