"""Manifests and table inputs are checked before they can fail mid-training (issue 30): a
manifest that does not fit the schema, a manifest whose sample counts were changed after
writing, and Parquet tables with empty (null) values or columns that are not numbers each stop
with one sentence naming what is wrong, exit code 2 from the CLI, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.config import DataConfig
from hpcml.data import shards
from hpcml.data.shards.convert import shard
from hpcml.data.sources import load_source
from hpcml.errors import DataError


@pytest.fixture(scope="module")
def small_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "s"
    # 100 samples of 3x32x32 float32 (12288 B + 8 B label): 60 KB shards hold 4, 20 train shards.
    shard("synthetic", out, shard_size="60KB", synthetic_samples=100, val_fraction=0.2)
    return out


def edited(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of shard set `src` at `dst` (shards linked) with its manifest changed by `edit`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "manifest.json":
            (dst / f.name).symlink_to(f)
    manifest = json.loads((src / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def one_sentence(args: list[str]) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _del(path: list[Any]) -> Any:
    def edit(m: dict[str, Any]) -> None:
        for key in path[:-1]:
            m = m[key]
        del m[path[-1]]

    return edit


def _set(path: list[Any], value: Any) -> Any:
    def edit(m: dict[str, Any]) -> None:
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_del(["sample"]), "sample: Field required"),
        (_del(["splits", "train", "shards", 0, "sha256"]), "splits.train.shards.0.sha256"),
        (_set(["splits", "train", "rows_per_batch"], "10"), "splits.train.rows_per_batch"),
        (_set(["splits", "train", "shards", 1, "file"], "../../etc/passwd"), "shards.1.file"),
        (_set(["sample", "x", "dtype"], "<U8"), "sample.x.dtype"),
        (
            _set(["splits", "val", "samples"], 21),
            "splits.val: samples is 21 but its shards hold 20",
        ),
    ],
)
def test_a_manifest_that_does_not_fit_the_schema_is_one_sentence(
    small_set: Path, tmp_path: Path, edit: Any, named: str
) -> None:
    """On main a missing key was a KeyError traceback (`data info`, `train`)."""
    bad = edited(small_set, tmp_path / "bad", edit)
    line = one_sentence(["data", "info", str(bad)])
    assert "is not a valid shard set manifest" in line and named in line, line
    with pytest.raises(DataError, match="is not a valid shard set manifest"):
        load_source(DataConfig(source="shards", path=str(bad)))


def test_a_sample_count_changed_after_writing_is_refused_at_load_and_when_read(
    small_set: Path, tmp_path: Path
) -> None:
    """Shard 2's count raised by 5 (and the split's, so the manifest is self-consistent): on
    main training started and died mid-run with `Batch number out of range` (exit 1)."""

    def raise_by_5(m: dict[str, Any]) -> None:
        m["splits"]["train"]["shards"][2]["samples"] += 5
        m["splits"]["train"]["samples"] += 5

    bad = edited(small_set, tmp_path / "bad", raise_by_5)
    msg = r"train-00002.arrow holds 4 samples in 1 record batches, but the manifest says 9"
    with pytest.raises(DataError, match=msg):  # at load: before any training step
        load_source(DataConfig(source="shards", path=str(bad)))
    line = one_sentence(["data", "info", str(bad), "--verify"])
    assert "holds 4 samples" in line
    # Read without the load-time check (as a remote set is): refused when the shard opens.
    ds = shards.ShardSet(bad, "train", shards.read_manifest(bad))
    assert len(ds[0]) == 2  # shard 0 is fine
    with pytest.raises(DataError, match=msg):
        ds[ds.starts[2]]


def table(path: Path, **columns: Any) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=16)
    return path


def test_parquet_nulls_and_non_numeric_columns_are_refused_naming_the_column(
    tmp_path: Path,
) -> None:
    """On main nulls became NaN features and string columns were dropped, silently."""
    rng = np.random.default_rng(5)
    n = 60
    f0 = rng.normal(size=n)
    f1 = pa.array([None if i in (7, 40) else float(i) for i in range(n)], pa.float64())
    label = rng.integers(0, 3, size=n)
    holes = table(tmp_path / "holes.parquet", f0=f0, f1=f1, label=label)
    line = one_sentence(["data", "shard", str(holes), "--out", str(tmp_path / "a")])
    assert "column 'f1'" in line and "row 7" in line and "--fill" in line, line
    assert not (tmp_path / "a").exists()  # nothing half-written is left
    # --fill writes the number given in their place, and records it in the manifest.
    res = CliRunner().invoke(
        app, ["data", "shard", str(holes), "--out", str(tmp_path / "b"), "--fill", "99",
              "--val-fraction", "0"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    ds = shards.ShardSet(tmp_path / "b", "train", with_ids=True)
    got = {int(sid): float(x[1]) for x, _, sid in (ds[i] for i in range(len(ds)))}
    assert got[7] == got[40] == 99.0 and got[8] == 8.0
    assert shards.read_manifest(tmp_path / "b")["transform"]["write"]["fill"] == 99.0

    words = table(tmp_path / "words.parquet", f0=f0, name=["x"] * n, label=label)
    line = one_sentence(["data", "shard", str(words), "--out", str(tmp_path / "c")])
    assert "column 'name'" in line and "holds string" in line and "--features" in line, line
    res = CliRunner().invoke(
        app, ["data", "shard", str(words), "--out", str(tmp_path / "d"), "--features", "f0"]
    )
    assert res.exit_code == 0, res.output
    assert shards.read_manifest(tmp_path / "d")["features"] == ["f0"]

    no_label = pa.array([None, *label[1:].tolist()], pa.int64())
    unlabelled = table(tmp_path / "unlabelled.parquet", f0=f0, label=no_label)
    line = one_sentence(["data", "shard", str(unlabelled), "--out", str(tmp_path / "e")])
    assert "column 'label' (the label)" in line and "1 empty" in line, line
