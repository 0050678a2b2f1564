"""`hpcml data shard SOURCE`: turn a data source into a shard set, and `data.source: shards`.

Sources: the built-in ones by name (`digits`, `cifar10`, `synthetic`: their train/val tensors
as float32, exactly what training on that source would read; `tokens`: non-overlapping windows
of `seq_len + 1` uint16 tokens), an image folder (one subfolder per class, read with Pillow,
resized, stored as uint8 and scaled/normalised at read time), a Parquet or Arrow table (one
label column, the other numeric columns as a float32 feature vector), WebDataset tar shards and
a Hugging Face `datasets` folder (`hpcml.data.sources.interop`). Image folders and tables
go to validation by a hash of the file path / row number, so the split does not depend on
file order. The manifest records the source, every option that shaped the bytes (`transform`)
and the hpcml version.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hpcml import __version__
from hpcml.config import DataConfig
from hpcml.data import shards
from hpcml.data.shards.loading import check_shards as check_shards  # re-exported, as before
from hpcml.data.shards.loading import device_normalize as device_normalize
from hpcml.data.shards.loading import is_image_set as is_image_set
from hpcml.data.shards.loading import load_shard_source as load_shard_source
from hpcml.data.shards.loading import shuffle_window as shuffle_window
from hpcml.errors import DataError

BUILTIN = ("digits", "cifar10", "synthetic", "tokens")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
Samples = dict[str, Iterator[tuple[int, np.ndarray, np.ndarray]]]


def _val(key: str, fraction: float) -> bool:
    return zlib.crc32(key.encode()) % 10_000 < fraction * 10_000


def from_builtin(cfg: DataConfig) -> tuple[Samples, dict[str, Any]]:
    if cfg.source == "tokens":
        return from_tokens(cfg)
    from hpcml.data.sources import load_source

    splits = load_source(cfg)

    def items(ds: Any) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        xs, ys = ds.tensors  # the tensor sources hold TensorDatasets
        for i in range(len(ys)):
            yield i, xs[i].numpy(), ys[i].numpy()

    header = {
        "sample": {
            "layout": "tensor",
            "x": shards.spec(np.float32, splits.input_shape),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": splits.num_classes,
        "source": {"name": cfg.source, "path": cfg.path, "fingerprint": splits.fingerprint},
        # What shaped the bytes: the source's own config (its loader's preprocessing is fixed
        # per source and hpcml version, both recorded); nothing more is applied at read time.
        "transform": {"source_config": _source_config(cfg), "read": {}},
    }
    return {"train": items(splits.train), "val": items(splits.val)}, header


def _source_config(cfg: DataConfig) -> dict[str, Any]:
    keep = {"source", "path", "val_fraction", "synthetic_samples", "synthetic_shape"}
    keep |= {"synthetic_classes", "seq_len", "eval_windows"}
    return {k: v for k, v in cfg.model_dump(mode="json").items() if k in keep}


def from_tokens(cfg: DataConfig) -> tuple[Samples, dict[str, Any]]:
    from hpcml.data.sources.tokens import TokenWindows, load_tokens

    splits = load_tokens(cfg)
    seq = cfg.seq_len

    def windows(ds: TokenWindows, starts: Any) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        tokens = ds.tokens()
        for i, start in enumerate(starts):
            yield i, np.asarray(tokens[start : start + seq + 1]), np.zeros((), np.int64)

    train, val = splits.train, splits.val
    # Training: non-overlapping windows covering the training tokens once; validation: the
    # windows data.source tokens evaluates on (data.eval_windows of them).
    train_starts = range(0, train.n_tokens - seq - 1 + 1, seq)
    val_starts = (
        [int(s) for s in val.starts] if val.starts is not None else range(0, val.n_starts + 1, seq)
    )
    header = {
        "sample": {
            "layout": "tokens",
            "x": shards.spec(np.uint16, (seq + 1,)),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": splits.num_classes,
        "seq_len": seq,
        "source": {"name": "tokens", "path": cfg.path, "fingerprint": splits.fingerprint},
        "transform": {
            "source_config": _source_config(cfg),
            "windows": "train: non-overlapping, stride seq_len; val: the tokens source's eval windows",
            "read": {},
        },
    }
    return {"train": windows(train, train_starts), "val": windows(val, val_starts)}, header


def from_image_folder(
    root: Path, image_size: int, val_fraction: float, encoded: bool = False
) -> tuple[Samples, dict[str, Any]]:
    """An image folder's images resized to `image_size` and stored as pixels, or with `encoded`
    stored as their files' bytes (each checked to decode) and resized when read, in the
    loader's workers."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(
            f"image folder {root} has no class subfolders; put each class's images in its own "
            "subfolder (root/cat/1.png, root/dog/2.png)."
        )
    files = [
        (rel, label)
        for label, name in enumerate(classes)
        for rel in sorted(
            p.relative_to(root).as_posix()
            for p in (root / name).rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
        )
    ]
    if not files:
        raise DataError(f"image folder {root} holds no images ({', '.join(IMAGE_SUFFIXES)}).")

    def items(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        from PIL import Image, UnidentifiedImageError

        for sid, (rel, label) in enumerate(files):
            if _val(rel, val_fraction) != (split == "val"):
                continue
            try:
                with Image.open(root / rel) as im:
                    rgb = im.convert("RGB").resize(
                        (image_size, image_size), Image.Resampling.BILINEAR
                    )
            except (UnidentifiedImageError, OSError) as exc:
                raise DataError(
                    f"image {root / rel} cannot be read ({type(exc).__name__}); remove or "
                    "replace it."
                ) from None
            if encoded:
                raw = np.frombuffer((root / rel).read_bytes(), dtype=np.uint8)
                yield sid, raw, np.asarray(label, dtype=np.int64)
                continue
            chw = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
            yield sid, chw, np.asarray(label, dtype=np.int64)

    resize = {"convert": "RGB", "resize": [image_size, image_size], "filter": "bilinear"}
    read: dict[str, Any] = {"scale": 1 / 255, "mean": [0.5] * 3, "std": [0.5] * 3}
    if encoded:
        read["decode"] = resize
    header = {
        "sample": {
            "layout": "encoded" if encoded else "tensor",
            "x": shards.spec(np.uint8, (3, image_size, image_size)),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": len(classes),
        "classes": classes,
        "source": {"name": "image_folder", "path": str(root), "files": len(files)},
        "transform": {
            "write": {"stored": "file bytes"} if encoded else resize,
            "val_fraction": val_fraction,
            "read": read,
        },
    }
    return {"train": items("train"), "val": items("val")}, header


def from_table(
    path: Path,
    label: str,
    val_fraction: float,
    features: list[str] | None = None,
    fill: float | None = None,
) -> tuple[Samples, dict[str, Any]]:
    """A Parquet or Arrow table: `label` holds class numbers, `features` (default every other
    column) must be numeric. An empty (null) feature value is refused, naming the column,
    unless `fill` gives the number to write in its place; an empty label always is."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    fmt = "parquet" if path.suffix.lower() == ".parquet" else "ipc"
    try:
        ds = pads.dataset(str(path), format=fmt)
        schema = ds.schema
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"table {path} cannot be read as {fmt} ({exc}).") from None
    if label not in schema.names:
        raise DataError(
            f"table {path} has no column {label!r} (columns: {', '.join(schema.names)}); pass "
            "the label column with --label."
        )
    names = _feature_columns(path, schema, label, features)
    if fill is not None and not math.isfinite(fill):
        raise DataError(f"--fill {fill} must be a finite number.")
    label_col = ds.to_table(columns=[label]).column(0)
    if label_col.null_count:
        raise DataError(
            f"column {label!r} (the label) of table {path} has {label_col.null_count} empty "
            "(null) values; every row needs a class number."
        )
    labels = label_col.to_numpy()
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise DataError(
            f"column {label!r} of {path} must hold class numbers 0..C-1 (found {labels.dtype})."
        )
    num_classes = int(labels.max()) + 1

    def column(batch: Any, i: int, first_row: int) -> np.ndarray:
        col = batch.column(i)
        if col.null_count:
            if fill is None:
                at = first_row + int(pc.index(pc.is_null(col), True).as_py())
                raise DataError(
                    f"column {names[i]!r} of table {path} has empty (null) values (the first in "
                    f"row {at}); fill them in the table, or pass --fill VALUE to write VALUE "
                    "in their place."
                )
            col = pc.fill_null(col.cast(pa.float64()), fill)
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float32)

    def items(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        row = 0
        for batch in ds.to_batches(columns=[*names, label], batch_size=4096):
            feats = np.stack([column(batch, i, row) for i in range(len(names))], axis=1)
            ys = batch.column(len(names)).to_numpy(zero_copy_only=False)
            for j in range(batch.num_rows):
                if _val(str(row), val_fraction) == (split == "val"):
                    yield row, feats[j], np.asarray(ys[j], dtype=np.int64)
                row += 1

    write: dict[str, Any] = {"features": names, "label": label, "dtype": "float32"}
    if fill is not None:
        write["fill"] = fill
    header = {
        "sample": {
            "layout": "tensor",
            "x": shards.spec(np.float32, (len(names),)),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": num_classes,
        "features": names,
        "source": {"name": "table", "path": str(path), "rows": int(len(labels))},
        "transform": {"write": write, "val_fraction": val_fraction, "read": {}},
    }
    return {"train": items("train"), "val": items("val")}, header


def _feature_columns(path: Path, schema: Any, label: str, features: list[str] | None) -> list[str]:
    """The feature columns: `features`, or every column but the label; each must hold numbers
    (integers, floats or booleans), or the column is named in one sentence."""
    import pyarrow as pa

    names = features if features is not None else [n for n in schema.names if n != label]
    for n in names:
        if n not in schema.names or n == label:
            raise DataError(
                f"--features names {n!r}, which is {'the label' if n == label else 'not a column'}"
                f" of table {path} (columns: {', '.join(schema.names)})."
            )
        t = schema.field(n).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise DataError(
                f"column {n!r} of table {path} holds {t}, not numbers; convert it to numbers in "
                "the table, or name the columns to use with --features (comma-separated)."
            )
    if not names:
        raise DataError(f"table {path} has no feature columns besides {label!r}.")
    return names


def _shard_key() -> Any:
    from hpcml import crypt

    key = crypt.key_from_env()
    if key is None:
        raise crypt.EncryptionError(
            f"--encrypt needs a key and none is given; set ${crypt.KEY_ENV} (64 hex digits, e.g. "
            f"from `openssl rand -hex 32`) or ${crypt.KEY_FILE_ENV} (a key file kept elsewhere)."
        )
    return key


def shard(
    source: str,
    out: Path,
    *,
    path: str | None = None,
    shard_size: str = "64MB",
    compression: str = "none",
    val_fraction: float = 0.2,
    image_size: int = 32,
    label: str = "label",
    seq_len: int = 256,
    synthetic_samples: int = 4096,
    features: list[str] | None = None,
    fill: float | None = None,
    encoded: bool = False,
    eot: int = 0,
    workers: int = 1,
    encrypt: bool = False,
) -> dict[str, Any]:
    """Write the shard set of `source` (a built-in name, an image folder or a table file);
    `encrypt`: each shard sealed with the key of the environment (hpcml.crypt)."""
    shard_bytes = shards.parse_size(shard_size)
    key = _shard_key() if encrypt else None
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1).")
    if source in BUILTIN and encoded:
        raise DataError(f"--encoded applies to image folders; {source!r} is a built-in source.")
    if source in BUILTIN:
        cfg = DataConfig(
            source=source,
            path=path,
            val_fraction=val_fraction,
            seq_len=seq_len,
            synthetic_samples=synthetic_samples,
        )
        samples, header = from_builtin(cfg)
    else:
        p = Path(source).expanduser()
        from hpcml.data.sources import interop

        if interop.is_hf_dataset(p):
            samples, header = interop.from_hf_disk(
                p, label, image_size, val_fraction, encoded, features, fill, seq_len, eot
            )
        elif interop.is_webdataset(p):
            samples, header = interop.from_webdataset(p, image_size, val_fraction, encoded)
        elif p.is_dir():
            samples, header = from_image_folder(p, image_size, val_fraction, encoded)
        elif encoded:
            raise DataError(f"--encoded applies to image folders; {source!r} is not one.")
        elif p.is_file() and p.suffix.lower() in TABLE_SUFFIXES:
            samples, header = from_table(p, label, val_fraction, features, fill)
        else:
            raise DataError(
                f"SOURCE {source!r} is neither a data source ({', '.join(BUILTIN)}), an image "
                f"folder, a table file ({', '.join(TABLE_SUFFIXES)}), WebDataset .tar shards "
                "nor a saved `datasets` folder."
            )
    header["hpcml"] = __version__
    manifest = shards.write_shard_set(out, samples, header, shard_bytes, compression, workers, key)
    return {"out": str(out), "version": shards.version_id(manifest), "manifest": manifest}
