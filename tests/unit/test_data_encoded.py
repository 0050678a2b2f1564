"""Encoded image shard sets (issue 30 item 7, first part): `hpcml data shard FOLDER --encoded`
stores each image file's bytes as they are (PNG and JPEG of other sizes than the training
size) and decodes them when read, in the loader's worker processes; the decoded samples equal,
bit for bit, those of the same folder resized at write time (the same Pillow calls)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet, read_manifest
from hpcml.data.shards.convert import shard


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("encoded") / "images"
    rng = np.random.default_rng(11)
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(16):  # 16 x 2 images, sizes 20..35 x 24..39, PNG and JPEG alternately
            h, w = 20 + i, 24 + i
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            pixels[..., c] = 255  # the classes differ
            suffix = ".png" if i % 2 else ".jpg"
            Image.fromarray(pixels).save(root / name / f"{i}{suffix}")
    return root


def test_encoded_images_read_back_as_the_resized_set(folder: Path, tmp_path: Path) -> None:
    plain, encoded = tmp_path / "plain", tmp_path / "encoded"
    shard(str(folder), plain, image_size=16, val_fraction=0.25)
    res = CliRunner().invoke(
        app, ["data", "shard", str(folder), "--out", str(encoded), "--image-size", "16",
              "--val-fraction", "0.25", "--encoded", "--shard-size", "4KB"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    manifest = read_manifest(encoded)
    assert manifest["sample"]["layout"] == "encoded"
    assert len(manifest["splits"]["train"]["shards"]) > 1
    for split in ("train", "val"):
        a = ShardSet(plain, split, with_ids=True)
        b = ShardSet(encoded, split, with_ids=True)
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            (xa, ya, ia), (xb, yb, ib) = a[i], b[i]
            assert ia == ib and int(ya) == int(yb) and torch.equal(xa, xb), (split, i)
    # What is stored is each file's bytes as they were.
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stored = set()
    for s in manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(encoded / s["file"]))).read_all()
        stored |= {v.as_py() for v in table.column("x")}
    assert stored == {p.read_bytes() for p in files}


def test_encoded_images_are_decoded_in_the_loader_workers(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "enc"
    shard(str(folder), out, image_size=16, val_fraction=0.25, encoded=True, shard_size="4KB")

    def epoch(workers: int) -> tuple[list[torch.Tensor], int]:
        ds = ShardSet(out, "train", with_ids=True)
        cfg = DataConfig(batch_size=4, num_workers=workers, persistent_workers=False)
        ld = EpochLoader(ds, cfg, 0, 1, 3, False)
        return [ld.next()[0] for _ in range(len(ld))], len(ds.slots)

    inline, opened_inline = epoch(0)
    in_workers, opened_here = epoch(2)
    assert opened_inline > 0 and opened_here == 0  # the workers read and decoded every image
    assert all(torch.equal(a, b) for a, b in zip(inline, in_workers, strict=True))
    res = CliRunner().invoke(
        app, ["data", "shard", "digits", "--out", str(tmp_path / "d"), "--encoded"]
    )
    assert res.exit_code == 2 and "--encoded applies to image folders" in res.stderr
