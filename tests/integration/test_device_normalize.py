"""`data.augment_on: device` moves normalization to the device where a source stores 8-bit
pixels (an image-folder shard set, cifar10): the loader hands over uint8, and every batch,
training and evaluation, must reach the model normalized exactly as the CPU path gives it.

What each test catches:
- the sources: a source that forgets to hand over uint8 (or normalizes twice);
- the training run: a trainer that skips normalization of training batches (first loss of a
  fresh model far above log C), of evaluation batches (its validation loss then differs from
  the exported model's on CPU-normalized data), or of the drift reference written at export
  (its profile then differs from the CPU path's).
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tests.conftest import run_hpcml, step_losses, summary

from hpcml.config import DataConfig
from hpcml.data import shards
from hpcml.data.drift import REFERENCE_FILE, load_profile, profile_dataset
from hpcml.data.shards.convert import shard
from hpcml.data.sources import load_source
from hpcml.models.export import load_export

CLASSES = 3


def _image_folder(root: Path) -> Path:
    rng = np.random.default_rng(7)
    for c in range(CLASSES):
        (root / f"c{c}").mkdir(parents=True)
        for k in range(24):
            # Class-dependent colour plus seeded noise: learnable, not constant.
            base = np.array([80 * c, 200 - 60 * c, 40 + 50 * c])
            img = np.clip(base + rng.normal(0, 40, size=(12, 12, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / f"c{c}" / f"{k}.png")
    return root


def _cifar_folder(root: Path) -> Path:
    rng = np.random.default_rng(3)
    root.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, size=(6, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, size=6)],
        }
        with open(root / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return root


def _pairs(cpu_ds, dev_ds, normalize) -> None:
    assert len(cpu_ds) == len(dev_ds)
    for i in range(len(cpu_ds)):
        raw, y_raw = dev_ds[i]
        ref, y_ref = cpu_ds[i]
        assert raw.dtype == torch.uint8
        assert ref.dtype == torch.float32
        assert torch.equal(normalize(raw), ref) and torch.equal(y_raw, y_ref)


def test_pixel_sources_hand_over_uint8_that_normalizes_to_the_cpu_inputs(tmp_path):
    out = tmp_path / "shards"
    shard(str(_image_folder(tmp_path / "imgs")), out, image_size=8, shard_size="2KB")
    cifar = _cifar_folder(tmp_path / "cifar")
    for source, path in (("shards", out), ("cifar10", cifar)):
        cpu = load_source(DataConfig(source=source, path=str(path)))
        dev = load_source(
            DataConfig(source=source, path=str(path), augment=True, augment_on="device")
        )
        assert cpu.device_normalize is None and dev.device_normalize is not None
        _pairs(cpu.val, dev.val, dev.device_normalize)
        _pairs(cpu.train, dev.train, dev.device_normalize)
    # By hand for one CIFAR pixel: (v / 255 - mean) / std per channel.
    dev = load_source(
        DataConfig(source="cifar10", path=str(cifar), augment=True, augment_on="device")
    )
    raw = dev.val[0][0]
    want = (raw[1, 2, 3].item() / 255 - 0.4822) / 0.2435
    assert math.isclose(dev.device_normalize(raw)[1, 2, 3].item(), want, rel_tol=1e-5)


def test_training_and_evaluation_see_normalized_inputs(tmp_path):
    out = tmp_path / "shards"
    shard(str(_image_folder(tmp_path / "imgs")), out, image_size=8, shard_size="2KB")
    run = tmp_path / "run"
    run_hpcml(
        "train",
        "examples/digits_cnn.yaml",
        "data.source=shards",
        f"data.path={out}",
        "data.augment=true",
        "data.augment_on=device",
        "model.name=mlp",
        "model.args={hidden: 32}",
        "data.batch_size=8",
        "train.max_steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "--run-dir",
        str(run),
        "--quiet",
    )
    # A fresh MLP on inputs in [-1, 1] starts at a few nats (2.2 with these seeds); on raw pixels
    # (0..255, normalization skipped) its logits are two orders of magnitude larger and the
    # first loss is about 20 nats (seen with the trainer's call removed).
    assert step_losses(run)[1] < 8.0

    # Evaluation: the trainer's validation loss equals the exported model's on the CPU path's
    # normalized inputs (float64 sums on both sides; 1e-5 covers float32 logits in another
    # batch order).
    model, _ = load_export(run / "export")
    val = shards.ShardSet(out, "val")
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.stack([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        want = F.cross_entropy(model(x).double(), y).item()
    got = summary(run)["final"]["val_loss"]
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)

    # The drift reference at export profiles normalized inputs, as the CPU path would.
    cpu_train = load_source(DataConfig(source="shards", path=str(out))).train
    ref = profile_dataset(cpu_train, seed=summary(run)["config"]["train"]["seed"])
    saved = load_profile(run / "export" / REFERENCE_FILE)
    assert saved.to_json() == ref.to_json()


def test_augmentation_is_refused_on_shard_sets_that_are_not_images(tmp_path):
    from hpcml.config import RunConfig
    from hpcml.errors import ConfigError
    from hpcml.train.validate import check_augment

    images, table = tmp_path / "images", tmp_path / "table"
    shard(str(_image_folder(tmp_path / "imgs")), images, image_size=8)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"a": [0.5, 1.5] * 10, "b": [1, 2] * 10, "label": [0, 1] * 10}), rows)
    shard(str(rows), table)  # flat feature vectors
    data = {"source": "shards", "augment": True, "augment_on": "device"}
    check_augment(RunConfig.model_validate({"data": {**data, "path": str(images)}}))
    try:
        check_augment(RunConfig.model_validate({"data": {**data, "path": str(table)}}))
    except ConfigError as exc:
        assert "data.augment applies to the image sources" in str(exc) and str(table) in str(exc)
    else:
        raise AssertionError("augmentation of a non-image shard set was accepted")
