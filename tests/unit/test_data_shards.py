"""Shard sets: what is written is what is read (every source kind, with and without
compression, over several shards), the version id follows the bytes, and a corrupted or missing
shard is one sentence."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hpcml.config import DataConfig
from hpcml.data import shards
from hpcml.data.shards.convert import shard
from hpcml.data.sources import load_source
from hpcml.errors import DataError


def read_all(ds: shards.ShardSet) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_synthetic_shards_read_back_exactly_what_the_source_gives(tmp_path, compression):
    out = tmp_path / "s"
    # 300 samples of 3x8x8 float32 (768 B): 20 KB shards hold 26 each, so 12 shards.
    shard(
        "synthetic",
        out,
        shard_size="20KB",
        compression=compression,
        val_fraction=0.2,
        synthetic_samples=300,
    )
    kw = {"synthetic_samples": 300, "val_fraction": 0.2}
    ref = load_source(DataConfig(source="synthetic", **kw))
    got = load_source(DataConfig(source="shards", path=str(out)))
    manifest = shards.read_manifest(out)
    assert len(manifest["splits"]["train"]["shards"]) > 5  # the mapping crosses shard edges
    assert got.version == shards.version_id(manifest) == got.fingerprint
    assert len(got.train) == len(ref.train) and len(got.val) == len(ref.val)
    assert got.input_shape == ref.input_shape and got.num_classes == ref.num_classes
    for split in ("train", "val"):
        xs, ys = getattr(ref, split).tensors
        for i, (x, y) in enumerate(read_all(getattr(got, split))):
            assert torch.equal(x, xs[i]) and int(y) == int(ys[i]), (split, i)
    # Random access out of order, with a cache of one open shard, gives the same rows.
    one = shards.ShardSet(out, "train", cache_shards=1, with_ids=True)
    for i in np.random.default_rng(0).permutation(len(one))[:60]:
        x, y, sid = one[int(i)]
        assert sid == i and torch.equal(x, ref.train.tensors[0][i])


def test_version_follows_the_bytes_and_diff_names_what_changed(tmp_path):
    kw = {"synthetic_samples": 120, "val_fraction": 0.25}
    shard("synthetic", tmp_path / "a", shard_size="16KB", **kw)
    shard("synthetic", tmp_path / "b", shard_size="16KB", **kw)
    shard("synthetic", tmp_path / "c", shard_size="32KB", **kw)
    va, vb, vc = (shards.version_id(shards.read_manifest(tmp_path / n)) for n in "abc")
    assert va == vb  # the same input and options write the same version
    assert vc != va  # other shard boundaries are other files
    from typer.testing import CliRunner

    from hpcml.cli.app import app

    res = CliRunner().invoke(
        app, ["data", "diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"]
    )
    assert res.exit_code == 1, res.output  # differ: 1, as diff(1) and git diff --exit-code
    diff = json.loads(res.stdout)
    assert diff["same"] is False and diff["a"]["version"] == va and diff["b"]["version"] == vc
    assert {c["key"] for c in diff["changes"]} == {"train.shards", "val.shards"}
    res = CliRunner().invoke(
        app, ["data", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]
    )
    same = json.loads(res.stdout)
    assert res.exit_code == 0 and same["same"] is True and same["changes"] == []
    res = CliRunner().invoke(app, ["data", "diff", str(tmp_path / "a"), str(tmp_path / "c")])
    assert res.exit_code == 1 and "train.shards" in res.output


def test_a_corrupted_or_missing_shard_is_one_sentence(tmp_path):
    out = tmp_path / "s"
    shard("synthetic", out, shard_size="16KB", synthetic_samples=100)
    victim = out / "train-00001.arrow"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte: only the sha256 can tell
    victim.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train-00001.arrow does not match the sha256"):
        load_source(DataConfig(source="shards", path=str(out)))
    victim.unlink()
    with pytest.raises(DataError, match=r"train-00001.arrow .* is missing"):
        load_source(DataConfig(source="shards", path=str(out)))
    with pytest.raises(DataError, match="holds no manifest.json"):
        load_source(DataConfig(source="shards", path=str(tmp_path)))


def test_an_existing_folder_is_never_overwritten(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="already exists and is not an empty folder"):
        shard("synthetic", out, synthetic_samples=50)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"


def test_image_folder_shards_hold_the_pixels_and_classes(tmp_path):
    from PIL import Image

    root = tmp_path / "imgs"
    colors = {"cat": (255, 0, 0), "dog": (0, 128, 255)}
    for name, rgb in colors.items():
        (root / name).mkdir(parents=True)
        for k in range(12):
            # Each image's red channel also carries its number, so rows cannot be swapped.
            Image.new("RGB", (20, 10), (rgb[0] if k == 0 else k * 10, *rgb[1:])).save(
                root / name / f"{k}.png"
            )
    out = tmp_path / "s"
    shard(str(root), out, image_size=8, val_fraction=0.25, shard_size="1KB")
    m = shards.read_manifest(out)
    assert m["classes"] == ["cat", "dog"] and m["num_classes"] == 2
    got = {}
    for split in ("train", "val"):
        ds = shards.ShardSet(out, split, m, with_ids=True)
        for i in range(len(ds)):
            x, y, sid = ds[i]
            got[sid] = (split, x, int(y))
    files = sorted((f"{n}/{k}.png", c) for c, n in enumerate(colors) for k in range(12))
    assert sorted(got) == list(range(24))
    for sid, (rel, label) in enumerate(files):
        split, x, y = got[sid]
        assert y == label
        want_val = zlib.crc32(rel.encode()) % 10_000 < 0.25 * 10_000
        assert (split == "val") == want_val, rel
        k = int(rel.split("/")[1].split(".")[0])
        rgb = colors[rel.split("/")[0]]
        red = rgb[0] if k == 0 else k * 10
        want = (torch.tensor([red, *rgb[1:]], dtype=torch.float32) / 255 - 0.5) / 0.5
        # A uniform image resizes to itself; float32 of (v/255 - 0.5)/0.5 matches to 1 ulp.
        assert x.shape == (3, 8, 8)
        assert torch.allclose(x, want.view(3, 1, 1).expand(3, 8, 8), atol=1e-6)


def test_parquet_table_shards_hold_the_rows(tmp_path):
    rng = np.random.default_rng(3)
    n = 500
    f0, f1 = rng.normal(size=n), rng.integers(0, 100, size=n)
    label = rng.integers(0, 4, size=n)
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"f0": f0, "name": ["r"] * n, "f1": f1, "label": label}), path, row_group_size=64
    )
    out = tmp_path / "s"
    # "name" holds strings: named out with features (without, it is refused: test_data_manifest)
    shard(
        str(path), out, shard_size="2KB", val_fraction=0.2, compression="lz4",
        features=["f0", "f1"],
    )  # fmt: skip
    m = shards.read_manifest(out)
    assert m["features"] == ["f0", "f1"] and m["num_classes"] == 4
    seen = []
    for split in ("train", "val"):
        ds = shards.ShardSet(out, split, m, with_ids=True)
        for i in range(len(ds)):
            x, y, sid = ds[i]
            seen.append(sid)
            want = torch.tensor([f0[sid], f1[sid]], dtype=torch.float32)
            assert torch.equal(x, want) and int(y) == label[sid]
    assert sorted(seen) == list(range(n))


def test_token_shards_hold_the_training_windows(tmp_path):
    data = tmp_path / "tok"
    data.mkdir()
    tokens = np.random.default_rng(1).integers(0, 256, size=4000).astype(np.uint16)
    tokens.tofile(data / "train.bin")
    tokens[:900].tofile(data / "val.bin")
    out = tmp_path / "s"
    shard("tokens", out, path=str(data), seq_len=32, shard_size="1KB")
    got = load_source(DataConfig(source="shards", path=str(out), seq_len=32))
    assert got.input_shape == (32,) and got.target_shape == (32,) and got.input_dtype == "int64"
    assert len(got.train) == (4000 - 33) // 32 + 1
    for i in (0, 1, 57, len(got.train) - 1):
        x, y = got.train[i]
        want = torch.from_numpy(tokens[i * 32 : i * 32 + 33].astype(np.int64))
        assert torch.equal(x, want[:-1]) and torch.equal(y, want[1:])


def test_bad_sizes_and_sources_are_sentences(tmp_path):
    assert shards.parse_size("64MB") == 64_000_000 and shards.parse_size("2KiB") == 2048
    with pytest.raises(DataError, match="--shard-size 'lots' is not a size"):
        shards.parse_size("lots")
    with pytest.raises(DataError, match="neither a data source"):
        shard(str(tmp_path / "nothing.csv"), tmp_path / "o")
    with pytest.raises(DataError, match="--compression 'gzip' is not known"):
        shard("synthetic", tmp_path / "o", compression="gzip")
    assert not (tmp_path / "o").exists()


def test_manifest_records_source_transform_and_version(tmp_path: Path):
    out = tmp_path / "s"
    shard("digits", out, shard_size="1MB", val_fraction=0.2)
    m = shards.read_manifest(out)
    ref = load_source(DataConfig(source="digits", val_fraction=0.2))
    assert m["source"] == {"name": "digits", "path": None, "fingerprint": ref.fingerprint}
    assert m["transform"]["source_config"]["val_fraction"] == 0.2
    from hpcml import __version__

    assert m["hpcml"] == __version__
    for s in m["splits"]["train"]["shards"]:
        assert s["sha256"] == shards.sha256_file(out / s["file"])
    assert m["splits"]["train"]["samples"] == len(ref.train)


def test_cifar10_shards_hold_what_the_cifar10_source_gives(tmp_path):
    """CIFAR-10 itself is not on this machine: batches in its official pickle format, written
    here with random pixels, stand in (the same reader reads both)."""
    import pickle

    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(5)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (12, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, 12)],
        }
        (root / name).write_bytes(pickle.dumps(batch))
    out = tmp_path / "s"
    shard("cifar10", out, path=str(tmp_path), shard_size="40KB")
    ref = load_source(DataConfig(source="cifar10", path=str(tmp_path)))
    got = load_source(DataConfig(source="shards", path=str(out)))
    assert len(shards.read_manifest(out)["splits"]["train"]["shards"]) > 1
    assert (len(got.train), len(got.val)) == (60, 12)  # 5 x 12 training, 12 test samples
    for split in ("train", "val"):
        xs, ys = getattr(ref, split).tensors
        for i, (x, y) in enumerate(read_all(getattr(got, split))):
            assert torch.equal(x, xs[i]) and int(y) == int(ys[i])
