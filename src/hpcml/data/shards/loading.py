"""`data.source: shards`: a shard set loaded for training (verified as `data.verify` says),
its shuffle window and its normalization; writing one is `hpcml.data.shards.convert`. A module
of its own so that `hpcml.data.sources` reaches it without importing the writers, which import
the sources."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpcml.config import DataConfig
from hpcml.data import shards
from hpcml.data.device_augment import DeviceNormalize
from hpcml.data.shards.store import is_remote
from hpcml.data.splits import Splits, pixels_on_device
from hpcml.errors import DataError


def load_shard_source(cfg: DataConfig) -> Any:
    """`data.source: shards`: the shard set at data.path, verified against its manifest."""
    root = check_shards(cfg)
    manifest = shards.read_manifest(root)
    if cfg.verify != "none":
        shards.verify(root, manifest, deep=None if cfg.verify == "full" else False, shared=True)
    normalize = device_normalize(cfg, manifest)
    crop = check_crop(cfg, manifest, root)
    train, val = (
        shards.ShardSet(
            root,
            split,
            manifest,
            cache_shards=cfg.shard_cache,
            cache_dir=cfg.cache_dir,
            cache_limit_bytes=int(cfg.cache_limit_gb * 10**9),
            readahead=cfg.readahead,
            raw=normalize is not None,
            shuffle_shards=shuffle_window(cfg),
            crop=crop if split == "train" else None,
        )
        for split in ("train", "val")
    )
    sample = manifest["sample"]
    version = shards.version_id(manifest)
    if sample["layout"] == "tokens":
        seq = int(manifest["seq_len"])
        return Splits(
            train,
            val,
            (seq,),
            int(manifest["num_classes"]),
            version,
            input_dtype="int64",
            target_shape=(seq,),
            version=version,
        )
    return Splits(
        train,
        val,
        tuple(sample["x"]["shape"]),
        int(manifest["num_classes"]),
        version,
        version=version,
        device_normalize=normalize,
    )


def shuffle_window(cfg: DataConfig) -> int | None:
    """Shards a shuffled epoch mixes at a time (data.shuffle_shards); None: all of them."""
    if cfg.shuffle_shards is not None:
        return cfg.shuffle_shards
    return max(1, cfg.shard_cache - 1) if is_remote(cfg.path or "") else None


def check_crop(cfg: DataConfig, manifest: dict[str, Any], root: Any) -> Any:
    """data.random_resized_crop: its (low, high) area share, for a set of encoded images."""
    crop = cfg.random_resized_crop
    if crop is None:
        return None
    if manifest["sample"]["layout"] != "encoded":
        raise DataError(
            f"data.random_resized_crop crops images stored as their files' bytes, but shard set "
            f"{root} stores {manifest['sample']['layout']} samples; write it with `hpcml data "
            "shard FOLDER --encoded` or unset data.random_resized_crop."
        )
    if crop[0] > crop[1]:
        raise DataError(
            f"data.random_resized_crop {list(crop)} is not a range (low, high); write the "
            "smaller area share first, e.g. [0.08, 1.0]."
        )
    return (float(crop[0]), float(crop[1]))


def is_image_set(manifest: dict[str, Any]) -> bool:
    """Samples are (C, H, W) images, which crop, flip, mixup and cutmix apply to."""
    sample = manifest["sample"]
    return sample["layout"] in ("tensor", "encoded") and len(sample["x"]["shape"]) == 3


def device_normalize(cfg: DataConfig, manifest: dict[str, Any]) -> Any:
    """With data.augment_on: device, an image set stored as uint8 pixels is read as stored and
    normalized on the device (`hpcml.data.device_augment`); None where the reader normalizes."""

    t = manifest.get("transform", {}).get("read", {})
    x = manifest["sample"]["x"]
    if not (pixels_on_device(cfg) and is_image_set(manifest) and np.dtype(x["dtype"]) == np.uint8):
        return None
    if not shards.is_pixel_transform(t):
        return None
    return DeviceNormalize(float(t["scale"]), tuple(t["mean"]), tuple(t["std"]))


def check_shards(cfg: DataConfig) -> str | Path:
    """data.path of a shard set: a local folder, or an s3:// URL (`hpcml.data.shards.store`)."""
    if cfg.path is None:
        raise DataError(
            "data source 'shards' needs data.path: a folder written by "
            "`hpcml data shard SOURCE --out DIR`, or an s3://BUCKET/PREFIX holding one."
        )
    root: str | Path = cfg.path if is_remote(cfg.path) else Path(cfg.path).expanduser()
    shards.read_manifest(root)
    return root
