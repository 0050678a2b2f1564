"""Random-resized-crop of encoded images at their stored resolution (issue 30 item 7,
`data.random_resized_crop`): the crop is cut from the full-resolution image before the resize
(never from the image already shrunk to the training size), drawn per (seed, epoch, sample) in
the loader workers, so workers and resumes change nothing, and refused in one sentence where it
cannot apply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hpcml.config import DataConfig, MixSource
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet
from hpcml.data.shards.convert import shard
from hpcml.data.shards.crop import RATIO, crop_box
from hpcml.data.sources import load_source
from hpcml.errors import DataError

SIZE = 16  # the training image size; the stored images are 64 x 64


@pytest.fixture(scope="module")
def encoded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 PNG images of a black/white checkerboard of 2-pixel squares, 64 x 64, stored as they
    are."""
    root = tmp_path_factory.mktemp("crop")
    board = (((np.indices((64, 64)) // 2).sum(axis=0) % 2) * 255).astype(np.uint8)
    for c in ("a", "b"):
        (root / "img" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.stack([board] * 3, axis=-1)).save(root / "img" / c / f"{i}.png")
    out = root / "enc"
    shard(str(root / "img"), out, image_size=SIZE, val_fraction=0.3, encoded=True)
    return out


def test_the_crop_is_cut_at_the_stored_resolution(encoded: Path) -> None:
    """Shrunk whole to 16 x 16 (4 source pixels to 1) the checkerboard averages to grey; a
    crop of 1/16 of its area (about 16 x 16 source pixels) resized to 16 x 16 keeps its black
    and white squares. Cropping the already shrunk image instead would give grey as well."""
    whole = ShardSet(encoded, "train")
    cropped = ShardSet(encoded, "train", crop=(1 / 16, 1 / 16))
    # Std of the normalized pixels ((v / 255 - 0.5) / 0.5): 1 for the checkerboard itself, 0
    # for grey. The crop's resize from 14-18 source pixels to 16 blends some neighbours.
    assert float(whole[0][0].std()) < 0.05
    stds = [float(cropped[(7, e, i)][0].std()) for e in range(3) for i in range(len(cropped))]
    assert min(stds) > 0.5, stds


def test_crops_are_drawn_per_sample_and_epoch_alike_in_workers(encoded: Path) -> None:
    def epochs(workers: int) -> list[torch.Tensor]:
        ds = ShardSet(encoded, "train", with_ids=True, crop=(0.05, 0.5))
        cfg = DataConfig(batch_size=4, num_workers=workers, persistent_workers=False)
        ld = EpochLoader(ds, cfg, 0, 1, 3, False)
        out = []
        for _ in range(2 * len(ld)):  # two epochs
            x, _, ids = ld.next()
            out += [x[k] for k in torch.argsort(ids)]  # by sample, whatever the order
        return out

    inline, in_workers = epochs(0), epochs(2)
    assert all(torch.equal(a, b) for a, b in zip(inline, in_workers, strict=True))
    n = len(inline) // 2
    # Another epoch, another crop of the same sample; and samples differ from each other.
    assert all(not torch.equal(inline[k], inline[n + k]) for k in range(n))
    assert not torch.equal(inline[0], inline[1])


def test_crop_boxes_stay_within_the_image_and_the_ranges() -> None:
    """The box: inside the image, its area share within `scale` and its aspect ratio within
    RATIO (up to the rounding to whole pixels: at most 1 pixel per side, a relative 2 / side),
    on images whose every draw fits (aspect 0.8-1.25, at most half the area); and the centred
    fallback where none can fit."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        h_img = int(rng.integers(40, 300))
        w_img = int(h_img * rng.uniform(0.8, 1.25))
        top, left, h, w = crop_box(h_img, w_img, (0.08, 0.5), rng)
        assert top >= 0 and top + h <= h_img and left >= 0 and left + w <= w_img
        slack = 2 / min(h, w)
        assert 0.08 * (1 - slack) <= h * w / (h_img * w_img) <= 0.5 * (1 + slack)
        assert RATIO[0] * (1 - slack) <= w / h <= RATIO[1] * (1 + slack)
    # A 1000 x 10 strip holds no crop of half its area with a ratio of 3/4..4/3: the whole
    # width, the height of ratio 3/4 (13 pixels), centred.
    assert crop_box(1000, 10, (0.5, 1.0), rng) == ((1000 - 13) // 2, 0, 13, 10)


def test_crops_are_refused_where_they_cannot_apply(encoded: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shard("synthetic", plain, synthetic_samples=40, shard_size="40KB")
    cases = [
        (DataConfig(source="shards", path=str(plain), random_resized_crop=(0.1, 1)), "stores tensor samples"),
        (DataConfig(source="digits", random_resized_crop=(0.1, 1)), "not to data.source digits"),
        (DataConfig(source="shards", mix=[MixSource(path=str(encoded), weight=1)], random_resized_crop=(0.1, 1)), "not to data.mix"),
        (DataConfig(source="shards", path=str(encoded), random_resized_crop=(0.9, 0.5)), "is not a range"),
    ]  # fmt: skip
    for cfg, words in cases:
        with pytest.raises(DataError, match=words):
            load_source(cfg)
    got = load_source(DataConfig(source="shards", path=str(encoded), random_resized_crop=(0.1, 1)))
    assert got.train.crop == (0.1, 1.0) and got.val.crop is None  # type: ignore[attr-defined]
