"""Data sources by name: each returns a train and a validation `Dataset` of (input, label).

`digits` is scikit-learn's bundled handwritten digits (real data, offline), upsampled to
3x32x32 so the CIFAR-shaped CNNs take it unchanged. `cifar10` reads the official
python-pickle batches from a local folder (numpy arrays and plain data only: no other global is
unpickled). `synthetic` is random tensors of a given shape.
`tokens` reads uint16 token files for language models (`hpcml.data.sources.tokens`); `shards` reads a
shard set written by `hpcml data shard` (`hpcml.data.shards`).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from hpcml.config import DataConfig
from hpcml.data.device_augment import DeviceNormalize
from hpcml.data.splits import Splits as Splits  # re-exported: where callers have found it
from hpcml.data.splits import pixels_on_device as pixels_on_device
from hpcml.errors import DataError

# The validation split must not move when the training seed changes: fixed split seed.
SPLIT_SEED = 1234
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def _split(n: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SPLIT_SEED)
    perm = torch.randperm(n, generator=g)
    n_val = int(round(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def _hash_arrays(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits, (1797, 8, 8) float32 images of 0..16 and their labels, read
    from the file scikit-learn ships (sklearn/datasets/data/digits.csv.gz: 64 pixels then the
    label per row, what its `load_digits` parses) without importing scikit-learn: that import
    (SciPy's stats, pandas, pyarrow) cost every digits process 1.7-1.9 CPU s even with torch
    and the trainer imported, the file 0.01 s. Where the file is not where it was (another
    scikit-learn layout), `load_digits` itself."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or spec.origin is None:
        raise DataError(
            "data source 'digits' needs scikit-learn; install it with pip install scikit-learn."
        )
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        with gzip.open(path, "rt") as fh:
            rows = np.loadtxt(fh, delimiter=",")
        images, labels = rows[:, :-1].reshape(-1, 8, 8), rows[:, -1]
    else:  # pragma: no cover (no scikit-learn release moved it so far)
        from sklearn.datasets import load_digits as sk_load_digits

        bunch = sk_load_digits()
        images, labels = bunch.images, bunch.target
    return np.asarray(images, dtype=np.float32), np.asarray(labels, dtype=np.int64)


def load_digits(cfg: DataConfig) -> Splits:
    images, labels = digits_arrays()  # (1797, 8, 8), values 0..16
    x = torch.from_numpy(images).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = ((x - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
    y = torch.from_numpy(labels)
    train_idx, val_idx = _split(len(y), cfg.val_fraction)
    xt, yt = x[train_idx], y[train_idx]
    return Splits(
        TensorDataset(xt, yt),
        TensorDataset(x[val_idx], y[val_idx]),
        (3, 32, 32),
        10,
        _hash_arrays(images, labels),
    )


class AugmentedImages(Dataset):
    """Random crop (pad 4) + horizontal flip, the standard CIFAR augmentation, around any image
    dataset (a Subset from `data.limit_train` included).

    The randomness of a sample is a function of (seed, epoch, index) alone: the loader's sampler
    yields those keys (`epoch_keyed`), and each sample draws from a numpy generator seeded with
    them. So which worker loads a sample, how many workers there are and where a resume starts
    change nothing: a resume with `data.num_workers` > 0 crops and flips exactly as the run it
    continues. (Drawing from torch's global generator, seeded per worker by the DataLoader, made
    a resumed worker start a random stream the first run's workers had already advanced.)
    A plain index (no loader) counts as epoch 0 with seed 0.
    """

    epoch_keyed = True

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        # A shard set's epoch order (a window of shards at a time, dealt to the readers) is
        # kept: augmenting must not turn a set in a bucket back to one permutation.
        self.has_epoch_order = getattr(inner, "has_epoch_order", False)
        self.dealt = getattr(inner, "dealt", False)
        self.order_always = getattr(inner, "order_always", False)

    def epoch_order(self, seed: int, epoch: int, pieces: list[int] | None = None) -> Any:
        if pieces is None:
            return self.inner.epoch_order(seed, epoch)  # type: ignore[attr-defined]
        return self.inner.epoch_order(seed, epoch, pieces)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        seed, epoch, i = key if isinstance(key, tuple) else (0, 0, int(key))
        img, label = self.inner[key if getattr(self.inner, "epoch_keyed", False) else i]
        rng = np.random.default_rng([seed, epoch, i])
        dx, dy = (int(v) for v in rng.integers(0, 9, size=2))
        h, w = img.shape[-2:]
        padded = F.pad(img, (4, 4, 4, 4), mode="reflect")
        img = padded[:, dy : dy + h, dx : dx + w]
        if rng.random() < 0.5:
            img = img.flip(-1)
        return img, label


def _cifar_dir(cfg: DataConfig) -> Path:
    if cfg.path is None:
        raise DataError(
            "data source 'cifar10' needs data.path: the folder holding cifar-10-batches-py "
            "(download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html "
            "and unpack it there)."
        )
    root = Path(cfg.path).expanduser()
    for candidate in (root, root / "cifar-10-batches-py"):
        if (candidate / "data_batch_1").exists():
            return candidate
    raise DataError(
        f"data.path {root} holds no CIFAR-10 batches (data_batch_1..5, test_batch); unpack "
        "cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html into that folder."
    )


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles what a CIFAR-10 batch holds (dicts, lists, bytes, numbers and numpy arrays)
    and refuses every other global, so a crafted file in data.path cannot run code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        # numpy scalars (labels written as numpy integers by re-packaged copies): data only.
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        # Protocol-2 pickles written by Python 3 spell bytes as _codecs.encode(str, "latin1").
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise _ForeignObject(f"{module}.{name}")
        return super().find_class(module, name)


class _ForeignObject(Exception):
    pass


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = _CifarUnpickler(f, encoding="bytes").load()
        data = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except FileNotFoundError:
        raise DataError(
            f"CIFAR-10 file {path} is missing; the folder needs data_batch_1..5 and test_batch."
        ) from None
    except _ForeignObject as exc:
        raise DataError(
            f"CIFAR-10 file {path} names {exc}, which a CIFAR-10 batch never holds, so it was "
            "not unpickled; re-download cifar-10-python.tar.gz from the official site."
        ) from None
    except Exception as exc:  # noqa: BLE001 - any unreadable pickle is the same user problem
        raise DataError(
            f"CIFAR-10 file {path} cannot be read as a python-pickle batch ({type(exc).__name__}); "
            "re-download cifar-10-python.tar.gz."
        ) from None
    return data, labels


def load_cifar10(cfg: DataConfig) -> Splits:
    root = _cifar_dir(cfg)
    parts = [_read_cifar_batch(root / f"data_batch_{i}") for i in range(1, 6)]
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = _read_cifar_batch(root / "test_batch")
    on_device = pixels_on_device(cfg)
    normalize = DeviceNormalize(1 / 255, CIFAR_MEAN, CIFAR_STD)

    def norm(a: np.ndarray) -> torch.Tensor:
        # uint8 as stored where the device normalizes (a quarter of the bytes in memory too)
        return torch.from_numpy(a) if on_device else normalize(torch.from_numpy(a))

    xt, yt = norm(xtr), torch.from_numpy(ytr)
    train: Dataset = TensorDataset(xt, yt)
    return Splits(
        train,
        TensorDataset(norm(xte), torch.from_numpy(yte)),
        (3, 32, 32),
        10,
        _hash_arrays(xtr, ytr, xte, yte),
        device_normalize=normalize if on_device else None,
    )


def load_synthetic(cfg: DataConfig) -> Splits:
    g = torch.Generator().manual_seed(SPLIT_SEED)
    shape = tuple(cfg.synthetic_shape)
    n = cfg.synthetic_samples
    x = torch.randn((n, *shape), generator=g)
    y = torch.randint(0, cfg.synthetic_classes, (n,), generator=g)
    train_idx, val_idx = _split(n, cfg.val_fraction if cfg.val_fraction > 0 else 0.1)
    return Splits(
        TensorDataset(x[train_idx], y[train_idx]),
        TensorDataset(x[val_idx], y[val_idx]),
        shape,
        cfg.synthetic_classes,
        f"synthetic:{SPLIT_SEED}:{n}:{shape}:{cfg.synthetic_classes}",
    )


def load_token_source(cfg: DataConfig) -> Splits:
    from hpcml.data.sources.tokens import load_tokens

    return load_tokens(cfg)  # type: ignore[no-any-return]


def load_shards(cfg: DataConfig) -> Splits:
    if cfg.mix is not None:
        from hpcml.data.shards.mix import load_mix

        return load_mix(cfg)
    from hpcml.data.shards.loading import load_shard_source

    return load_shard_source(cfg)  # type: ignore[no-any-return]


SOURCES: dict[str, Callable[[DataConfig], Splits]] = {
    "digits": load_digits,
    "cifar10": load_cifar10,
    "synthetic": load_synthetic,
    "tokens": load_token_source,
    "shards": load_shards,
}


def _check_crop_source(cfg: DataConfig) -> None:
    if cfg.random_resized_crop is not None and (cfg.source != "shards" or cfg.mix is not None):
        where = "data.mix" if cfg.source == "shards" else f"data.source {cfg.source}"
        raise DataError(
            f"data.random_resized_crop applies to one shard set of encoded images (data.source "
            f"shards, data.path), not to {where}; unset it or train from such a set."
        )


class KeyedSubset(Subset):  # type: ignore[type-arg]
    """`data.limit_train` over a dataset whose samples take (seed, epoch, index) keys."""

    epoch_keyed = True

    def _key(self, key: Any) -> Any:
        seed, epoch, i = key if isinstance(key, tuple) else (0, 0, int(key))
        return (seed, epoch, self.indices[i])

    def __getitem__(self, key: Any) -> Any:
        return self.dataset[self._key(key)]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        return [self.dataset[self._key(k)] for k in keys]


def check_source(cfg: DataConfig) -> None:
    """Cheap checks a launcher runs before starting workers (folders exist, name known)."""
    if cfg.source not in SOURCES:
        raise DataError(
            f"data.source {cfg.source!r} is not known; known sources are: {', '.join(sorted(SOURCES))}."
        )
    _check_crop_source(cfg)
    if cfg.source == "cifar10":
        _cifar_dir(cfg)
    if cfg.source == "tokens":
        from hpcml.data.sources.tokens import check_tokens

        check_tokens(cfg)
    if cfg.source == "shards" and cfg.mix is not None:
        from hpcml.data.shards.mix import check_mix

        check_mix(cfg)
    elif cfg.source == "shards":
        from hpcml.data.shards.loading import check_shards

        check_shards(cfg)


def load_source(cfg: DataConfig) -> Splits:
    loader = SOURCES.get(cfg.source)
    if loader is None:
        raise DataError(
            f"data.source {cfg.source!r} is not known; known sources are: {', '.join(sorted(SOURCES))}."
        )
    _check_crop_source(cfg)
    splits = loader(cfg)
    if cfg.limit_train is not None and cfg.limit_train < len(splits.train):  # type: ignore[arg-type]
        subset = KeyedSubset if getattr(splits.train, "epoch_keyed", False) else Subset
        splits.train = subset(splits.train, range(cfg.limit_train))
    # Outermost, so it sees the loader's (seed, epoch, index) keys; augment_on: device runs in
    # the trainer instead (hpcml.data.device_augment).
    if cfg.augment and cfg.augment_on == "cpu":
        splits.train = AugmentedImages(splits.train)
    return splits
