"""`hpcml data shard --workers N` (issue 30 item 7): shard files written by N spawned processes
while the source is read. The shard set must be the serial writer's byte for byte (every file
and the manifest, so the version id too), for fixed-size and for encoded samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.data.shards.convert import shard


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_parallel_writers_write_the_serial_shard_set(tmp_path: Path) -> None:
    # 100 synthetic samples of 3x32x32 float32 (12 KB) in zstd shards of 3: 27 + 7 shards,
    # far more than the 2 writers x 2 shards that may wait, so shards finish out of turn.
    kw = dict(shard_size="40KB", synthetic_samples=100, compression="zstd", val_fraction=0.2)
    serial = shard("synthetic", tmp_path / "serial", **kw)  # type: ignore[arg-type]
    parallel = shard("synthetic", tmp_path / "parallel", workers=2, **kw)  # type: ignore[arg-type]
    assert len(serial["manifest"]["splits"]["train"]["shards"]) == 27
    assert files(tmp_path / "parallel") == files(tmp_path / "serial")
    assert parallel["version"] == serial["version"]


def test_the_cli_writes_encoded_images_in_parallel_alike(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    for c in ("a", "b"):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(12):  # JPEG and PNG files of different sizes, stored as they are
            pixels = rng.integers(0, 256, size=(16 + i, 20 + i, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "img" / c / f"{i}.{'png' if i % 2 else 'jpg'}")
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"enc{workers}"
        args = ["data", "shard", str(tmp_path / "img"), "--out", str(out), "--encoded"]
        res = CliRunner().invoke(app, [*args, "--shard-size", "3KB", "--workers", str(workers)])
        assert res.exit_code == 0, res.output
        outs[workers] = files(out)
    assert len(outs[1]) > 5 and outs[2] == outs[1]
    bad = CliRunner().invoke(
        app, ["data", "shard", "digits", "--out", str(tmp_path / "d"), "--workers", "0"]
    )
    assert bad.exit_code == 2 and "--workers 0 must be at least 1" in bad.stderr
    assert not (tmp_path / "d").exists()
