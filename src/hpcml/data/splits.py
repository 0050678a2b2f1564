"""What every data source returns (`Splits`), in a module of its own so that the sources
(`hpcml.data.sources`, `tokens`, `shard_loading`) import it from below instead of from each
other."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset

from hpcml.config import DataConfig
from hpcml.data.device_augment import DeviceNormalize


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]
    num_classes: int
    fingerprint: str
    """sha256 over the bytes read, so a run can be traced to exactly the data it saw."""
    input_dtype: str = "float32"
    """Per-sample input dtype: token sources give int64 ids."""
    target_shape: tuple[int, ...] = ()
    """Per-sample target shape: () for one class per sample, (seq_len,) for next tokens."""
    version: str | None = None
    """A shard set's version id (sha256 of its manifest); None for other sources."""
    device_normalize: DeviceNormalize | None = None
    """Set where the source hands over uint8 pixels and leaves normalization to the training
    device (`data.augment_on: device`); every batch, train and eval, goes through it."""


def pixels_on_device(cfg: DataConfig) -> bool:
    """The source hands over uint8 pixels and the device normalizes them."""
    return cfg.augment and cfg.augment_on == "device"
