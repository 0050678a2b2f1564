"""Random-resized-crop of an encoded image at its stored resolution (`data.random_resized_crop`).

The crop box is drawn as torchvision's `transforms.v2.RandomResizedCrop.make_params` draws it
(up to 10 tries of an area share in `scale` and a log-uniform aspect ratio in `ratio`, then a
centred crop of the whole image clamped to `ratio`), from a numpy generator seeded with the
sample's (seed, epoch, index), so which loader worker reads a sample and where a resume starts
change nothing. torchvision itself is not a dependency: the PyPI wheel of the torchvision that
matches the pinned torch (0.28.0 for 2.13.0) is a CUDA build whose operators do not load with
the CPU torch. The box is cut from the full-resolution image and resized by Pillow in one call
(`Image.resize(size, box=...)`, bilinear), the resize `decode_rgb` uses for a whole image."""

from __future__ import annotations

import io
import math

import numpy as np

RATIO = (3 / 4, 4 / 3)
"""Aspect ratios (width / height) of the crop: RandomResizedCrop's default."""


def crop_box(
    height: int, width: int, scale: tuple[float, float], rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width) of a random crop of a `height` x `width` image."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height  # fallback: the whole image, clamped to RATIO, centred
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(
    data: bytes | memoryview,
    height: int,
    width: int,
    scale: tuple[float, float],
    rng: np.random.Generator,
) -> np.ndarray:
    """(3, height, width) uint8 pixels of a random crop of image file bytes at their own
    resolution. Bytes that are not a readable image raise ValueError naming Pillow's error."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB")
            top, left, h, w = crop_box(rgb.height, rgb.width, scale, rng)
            box = (left, top, left + w, top + h)
            out = rgb.resize((width, height), Image.Resampling.BILINEAR, box=box)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(type(exc).__name__) from None
    return np.asarray(out, dtype=np.uint8).transpose(2, 0, 1)
