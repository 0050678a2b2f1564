"""Encryption at rest (`encryption.enabled`, hpcml.crypt) through real `hpcml train` runs.

A run stopped at step 2 with its checkpoints and export sealed, then resumed to step 4, gives
the losses of an unencrypted run straight to 4 bit for bit; no checkpoint file but the
manifest, and not the exported weights, holds plaintext (each starts with the sealed header,
and the step-2 checkpoint's trainer state, plain in an unencrypted run, is nowhere in it).
A resume with another key, or with none, ends in one sentence with exit code 2 and leaves
every file of the run folder byte-identical. The encrypted export serves over HTTP with the
key in the server's environment (a real client on loopback), and is refused without it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tests.conftest import hpcml_env, run_hpcml, step_losses

from hpcml import crypt
from hpcml.serve.codec.oip import decode_output, encode_request
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

CONFIG = "examples/digits_cnn.yaml"
COMMON = [
    "model.name=mlp",
    "model.args={hidden: 32}",
    "data.batch_size=16",
    "train.eval_every=0",
    "train.log_every=1",
    "train.max_steps=4",
    "train.checkpoint_every=2",
    "optim.decay_steps=4",  # the split run keeps the 4-step schedule of the straight one
    "train.deterministic=true",
    "--quiet",
]
KEY = "11" * 32
OTHER_KEY = "22" * 32


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_encrypted_checkpoints_resume_bit_equal_and_a_wrong_key_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, split = tmp_path / "plain", tmp_path / "split"
    env = hpcml_env(HPCML_ENCRYPTION_KEY=KEY)
    run_hpcml("train", CONFIG, *COMMON, "--run-dir", str(plain))
    sealed = [*COMMON, "encryption.enabled=true"]
    run_hpcml("train", CONFIG, *sealed, "train.max_steps=2", "--run-dir", str(split), env=env)

    step2 = split / "checkpoints" / "step-2"
    files = [p for p in step2.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert {p.name for p in files} >= {"trainer.pt", "rank-0.pt", ".metadata"}
    assert all(crypt.file_is_sealed(p) for p in files), [p.name for p in files]
    # The plain run's trainer state at step 2 (the config's own text inside) is not readable.
    assert (
        b"decay_norms_biases_embeddings" in (plain / "checkpoints/step-2/trainer.pt").read_bytes()
    )
    assert not any(b"decay_norms_biases_embeddings" in p.read_bytes() for p in files)
    assert crypt.file_is_sealed(split / "export" / "model.safetensors")

    before = _tree_digest(split)
    for key in (OTHER_KEY, None):
        bad_env = hpcml_env(HPCML_ENCRYPTION_KEY=key) if key else hpcml_env()
        bad_env.pop("HPCML_ENCRYPTION_KEY_FILE", None)
        if key is None:
            bad_env.pop("HPCML_ENCRYPTION_KEY", None)
        proc = run_hpcml(
            "train", CONFIG, *COMMON, "--run-dir", str(split), "--resume", "auto",
            env=bad_env, check=False,
        )  # fmt: skip
        message = proc.stderr.strip()
        assert proc.returncode == 2, message
        assert len(message.splitlines()) == 1, message
        assert ("another key" if key else "no key is given") in message
        assert _tree_digest(split) == before  # nothing moved aside, rewritten or removed

    run_hpcml("train", CONFIG, *sealed, "--run-dir", str(split), "--resume", "auto", env=env)
    assert step_losses(split) == step_losses(plain)
    assert sorted(step_losses(split)) == [1, 2, 3, 4]

    # The sealed export serves with the key in the environment (process-isolated inference
    # inherits it), and is refused in one sentence without it.
    export = split / "export"
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    monkeypatch.delenv("HPCML_ENCRYPTION_KEY_FILE", raising=False)
    monkeypatch.delenv("HPCML_ENCRYPTION_KEY", raising=False)
    with pytest.raises(crypt.EncryptionError, match="no key is given"):
        build_app(export, ServeConfig(), name="digits")
    monkeypatch.setenv("HPCML_ENCRYPTION_KEY", KEY)
    from hpcml.models.export import load_export

    model, _ = load_export(export)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    with running_server(build_app(export, ServeConfig(), name="digits")) as url:
        r = httpx.post(f"{url}/v2/models/digits/infer", json=encode_request(x), timeout=60)
    assert r.status_code == 200, r.text
    # fp32 sums in another order (as test_serve_http): 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3;
    # weights that failed to decrypt or load would not serve at all, other weights differ > .1.
    np.testing.assert_allclose(decode_output(r.json()), expected, rtol=0, atol=3e-3)


def test_an_encrypted_shard_set_loads_as_the_plain_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hpcml data shard --encrypt`: every shard file is sealed (a sample's pixels are in the
    plain set's files and in none of the sealed ones) and the loader's batches are the plain
    set's; without the key, or with another, reading is refused in one sentence."""
    from hpcml.config import DataConfig
    from hpcml.data.loader import EpochLoader
    from hpcml.data.sources import load_source

    plain, sealed = tmp_path / "plain", tmp_path / "sealed"
    small = ["--shard-size", "256KB", "--val-fraction", "0.2"]
    run_hpcml("data", "shard", "digits", "--out", str(plain), *small)
    run_hpcml("data", "shard", "digits", "--out", str(sealed), *small, "--encrypt",
              env=hpcml_env(HPCML_ENCRYPTION_KEY=KEY))  # fmt: skip
    files = sorted(sealed.glob("*.arrow"))
    assert len(files) > 1 and all(crypt.file_is_sealed(f) for f in files)
    cfg = {"source": "shards", "batch_size": 16, "verify": "full"}
    monkeypatch.delenv("HPCML_ENCRYPTION_KEY_FILE", raising=False)
    monkeypatch.setenv("HPCML_ENCRYPTION_KEY", KEY)
    batches = []
    for root in (plain, sealed):
        splits = load_source(DataConfig(path=str(root), **cfg))
        loader = EpochLoader(splits.train, DataConfig(path=str(root), **cfg), 0, 1, 0, False)
        batches.append([loader.next() for _ in range(3)])
        assert len(splits.train) == 1438  # digits' 1,797 less the 359 held out
    for (xa, ya), (xb, yb) in zip(*batches, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    import pyarrow as pa

    first = sorted(plain.glob("train-*.arrow"))[0]
    raw = pa.ipc.open_file(pa.memory_map(str(first))).get_batch(0).column("x")[5].as_py()
    assert len(raw) >= 64 and raw in first.read_bytes()  # a sample's stored bytes
    assert not any(raw in f.read_bytes() for f in files)
    for key in (OTHER_KEY, None):
        if key is None:
            monkeypatch.delenv("HPCML_ENCRYPTION_KEY")
        else:
            monkeypatch.setenv("HPCML_ENCRYPTION_KEY", key)
        with pytest.raises(crypt.EncryptionError, match="another key" if key else "no key"):
            EpochLoader(load_source(DataConfig(path=str(sealed), **cfg)).train,
                        DataConfig(path=str(sealed), **cfg), 0, 1, 0, False).next()  # fmt: skip
