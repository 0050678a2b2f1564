"""WebDataset tar shards and Hugging Face `datasets` folders in (`hpcml data shard`), a shard
set out to WebDataset (`hpcml data to-webdataset`), each on a small set the test writes with
the format's own package (issue 30, item 8)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import in_ci
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.data.shards import ShardSet

try:  # the interop extra, which `make install` installs: missing, it fails under CI=true
    import datasets as hf
    import webdataset as wds
except ImportError:
    if in_ci():
        raise
    pytest.skip("pip install -e '.[interop]' (webdataset, datasets)", allow_module_level=True)
hf.disable_progress_bars()


def _png(hwc: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="PNG")
    return buf.getvalue()


def _all(folder: Path) -> dict[int, tuple[np.ndarray, int]]:
    """Every sample of both splits, by id, as stored (raw pixels or features)."""
    out = {}
    for split in ("train", "val"):
        s = ShardSet(folder, split, raw=True, with_ids=True)
        for i in range(len(s)):
            x, y, sid = s[i]
            out[int(sid)] = (x.numpy(), int(y))
    return out


def test_webdataset_tars_in_and_a_shard_set_out(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(24, 8, 8, 3), dtype=np.uint8)
    labels = rng.integers(0, 3, size=24)
    src = tmp_path / "wds"
    src.mkdir()
    for part in range(2):  # two tar shards of 12 samples
        with wds.TarWriter(str(src / f"part-{part}.tar")) as sink:
            for i in range(part * 12, part * 12 + 12):
                sink.write({"__key__": f"s{i:03d}", "png": _png(images[i]), "cls": int(labels[i])})
    cli = CliRunner()
    out = tmp_path / "shards"
    r = cli.invoke(app, ["data", "shard", str(src), "--out", str(out), "--image-size", "8",
                         "--val-fraction", "0.25", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["name"] == "webdataset" and manifest["num_classes"] == 3
    got = _all(out)
    assert sorted(got) == list(range(24))  # every sample once, over both splits
    assert 0 < len(ShardSet(out, "val")) < 24
    for i, (x, y) in got.items():  # pixels as written (8x8 needs no resize), classes kept
        assert y == labels[i] and np.array_equal(x, images[i].transpose(2, 0, 1)), i

    back = tmp_path / "back"
    r = cli.invoke(app, ["data", "to-webdataset", str(out), "--out", str(back), "--maxcount",
                         "10", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    train = ShardSet(out, "train", raw=True)
    assert json.loads(r.output)["shards"] == [f"train-{k:06d}.tar" for k in range(
        -(-len(train) // 10))]  # fmt: skip
    read = list(wds.WebDataset(sorted(str(p) for p in back.glob("*.tar")), shardshuffle=False)
                .decode("rgb8").to_tuple("png", "cls"))  # fmt: skip
    assert len(read) == len(train)
    for k, (hwc, cls) in enumerate(read):
        x, y = train[k]
        assert cls == int(y) and np.array_equal(hwc.transpose(2, 0, 1), x.numpy()), k


def test_a_saved_datasets_folder_in_with_its_splits_and_nulls_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n_train, n_test = 30, 10
    a = rng.normal(size=n_train + n_test).astype(np.float32)
    b = rng.integers(-5, 5, size=n_train + n_test)
    y = rng.integers(0, 4, size=n_train + n_test)
    feats = hf.Features({"a": hf.Value("float32"), "b": hf.Value("int64"),
                         "label": hf.ClassLabel(names=["w", "x", "y", "z"])})  # fmt: skip

    def part(sl: slice) -> object:
        return hf.Dataset.from_dict({"a": a[sl], "b": b[sl], "label": y[sl]}, features=feats)

    src = tmp_path / "hf"
    hf.DatasetDict({"train": part(slice(0, n_train)), "test": part(slice(n_train, None))}
                   ).save_to_disk(str(src))  # fmt: skip
    cli = CliRunner()
    out = tmp_path / "shards"
    r = cli.invoke(app, ["data", "shard", str(src), "--out", str(out)])
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["classes"] == ["w", "x", "y", "z"] and manifest["features"] == ["a", "b"]
    assert (len(ShardSet(out, "train")), len(ShardSet(out, "val"))) == (n_train, n_test)
    got = _all(out)
    assert sorted(got) == list(range(n_train + n_test))  # the test split is validation
    for i, (x, label) in got.items():
        assert label == y[i] and np.array_equal(x, np.array([a[i], b[i]], np.float32)), i

    # A null feature value: one sentence naming the column, exit 2, nothing written.
    holes = tmp_path / "holes"
    hf.Dataset.from_dict({"a": [1.0, None, 3.0], "b": [1, 2, 3], "label": [0, 1, 0]}
                         ).save_to_disk(str(holes))  # fmt: skip
    r = cli.invoke(app, ["data", "shard", str(holes), "--out", str(tmp_path / "no")])
    assert r.exit_code == 2, r.output
    assert "column 'a'" in r.output and "--fill" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "no").exists()
    filled = tmp_path / "filled"
    r = cli.invoke(app, ["data", "shard", str(holes), "--out", str(filled), "--fill", "7",
                         "--val-fraction", "0.5"])  # fmt: skip
    assert r.exit_code == 0, r.output
    got = _all(filled)
    assert [got[i][0][0] for i in sorted(got)] == [1.0, 7.0, 3.0]


def test_a_datasets_image_column_is_stored_as_pixels_and_bad_tars_are_refused(
    tmp_path: Path,
) -> None:
    from PIL import Image

    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, size=(6, 8, 8, 3), dtype=np.uint8)
    src = tmp_path / "hf_images"
    hf.Dataset.from_dict(
        {"image": [Image.fromarray(im) for im in images], "label": [0, 1, 2, 0, 1, 2]},
        features=hf.Features({"image": hf.Image(), "label": hf.Value("int64")}),
    ).save_to_disk(str(src))
    cli = CliRunner()
    out = tmp_path / "shards"
    r = cli.invoke(app, ["data", "shard", str(src), "--out", str(out), "--image-size", "8",
                         "--val-fraction", "0.5"])  # fmt: skip
    assert r.exit_code == 0, r.output
    got = _all(out)
    assert sorted(got) == list(range(6))
    for i, (x, y) in got.items():
        assert y == i % 3 and np.array_equal(x, images[i].transpose(2, 0, 1)), i

    bad = tmp_path / "bad"
    bad.mkdir()
    with wds.TarWriter(str(bad / "a.tar")) as sink:
        sink.write({"__key__": "k0", "png": _png(images[0])})  # no class
    r = cli.invoke(app, ["data", "shard", str(bad), "--out", str(tmp_path / "no")])
    assert r.exit_code == 2, r.output
    assert "sample 'k0'" in r.output and "KEY.cls" in " ".join(r.output.split())
    assert "Traceback" not in r.output and not (tmp_path / "no").exists()


def test_token_documents_of_any_length_are_packed_into_windows(tmp_path: Path) -> None:
    """An `input_ids` column of documents of 1..40 tokens: windows of seq_len + 1 tokens with
    stride seq_len over the documents, each followed by the EOT id, nothing padded."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 100, size=int(n)).tolist() for n in rng.integers(1, 41, size=60)]
    src = tmp_path / "docs"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"input_ids": docs[:50]}),
                    "validation": hf.Dataset.from_dict({"input_ids": docs[50:]})}
                   ).save_to_disk(str(src))  # fmt: skip
    out = tmp_path / "shards"
    r = CliRunner().invoke(app, ["data", "shard", str(src), "--out", str(out), "--seq-len", "16",
                                 "--eot", "0"])  # fmt: skip
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sample"]["layout"] == "tokens" and manifest["seq_len"] == 16
    for split, part in (("train", docs[:50]), ("val", docs[50:])):
        stream = np.concatenate([np.array([*d, 0]) for d in part])
        data = ShardSet(out, split)
        assert len(data) == (len(stream) - 1) // 16  # every full window, nothing padded
        for k in range(len(data)):
            x, y = data[k]
            want = stream[16 * k : 16 * k + 17]
            assert np.array_equal(x.numpy(), want[:-1]) and np.array_equal(y.numpy(), want[1:])
    assert manifest["num_classes"] == max(max(d) for d in docs) + 1
