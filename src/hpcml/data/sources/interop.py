"""Formats users already have: WebDataset tar shards and Hugging Face `datasets` folders
(`Dataset.save_to_disk`) read as sources of `hpcml data shard`, and a shard set written out as
WebDataset tar shards (`hpcml data to-webdataset`). Reading goes through the formats' own packages
(`webdataset`, `datasets`: the `interop` extra), so whatever they accept is read as they read it.

A WebDataset sample is an image (`jpg`, `jpeg`, `png`, `webp`, `bmp` key) and its class number
(`cls`); it goes to validation by a hash of its `__key__`, as an image folder's files do by path.
A `datasets` folder with a `train` split keeps its `validation` (or `test`) split; otherwise rows
go to validation by a hash of their number, as a table's do. Token documents of any length (an
`input_ids` column, as tokenizers write) are packed into windows of `--seq-len` + 1 tokens, each
document followed by `--eot`, without padding; images (an `Image` column) are stored as pixels
(or with `--encoded` as their bytes); otherwise the other columns must hold numbers and make the
feature vector, as a table's do (nulls refused, or `--fill`).
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.data import shards
from hpcml.errors import DataError

Samples = dict[str, Iterator[tuple[int, np.ndarray, np.ndarray]]]
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp")
TOKENS_COLUMN = "input_ids"


def _val(key: str, fraction: float) -> bool:
    return zlib.crc32(key.encode()) % 10_000 < fraction * 10_000


def _need(package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise DataError(
            f"reading this format needs the {package!r} package; install it with "
            "pip install 'hpcml[interop]'."
        ) from None


def is_webdataset(p: Path) -> bool:
    return (p.is_file() and p.suffix == ".tar") or (p.is_dir() and any(p.glob("*.tar")))


def is_hf_dataset(p: Path) -> bool:
    return p.is_dir() and any((p / f).is_file() for f in ("dataset_dict.json", "state.json"))


def _pixels(data: bytes, image_size: int, where: str) -> np.ndarray:
    try:
        return shards.decode_rgb(data, image_size, image_size)
    except ValueError as exc:
        raise DataError(f"{where} is not a readable image ({exc}); remove or replace it.") from None


def _image_header(image_size: int, encoded: bool, num_classes: int, source: dict[str, Any],
                  val_fraction: float) -> dict[str, Any]:  # fmt: skip
    resize = {"convert": "RGB", "resize": [image_size, image_size], "filter": "bilinear"}
    read: dict[str, Any] = {"scale": 1 / 255, "mean": [0.5] * 3, "std": [0.5] * 3}
    if encoded:
        read["decode"] = resize
    return {
        "sample": {
            "layout": "encoded" if encoded else "tensor",
            "x": shards.spec(np.uint8, (3, image_size, image_size)),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": num_classes,
        "source": source,
        "transform": {
            "write": {"stored": "file bytes"} if encoded else resize,
            "val_fraction": val_fraction,
            "read": read,
        },
    }


def _image_sample(data: bytes, image_size: int, encoded: bool, where: str) -> np.ndarray:
    pixels = _pixels(data, image_size, where)  # every image is checked to decode
    return np.frombuffer(data, dtype=np.uint8) if encoded else pixels


def from_webdataset(
    path: Path, image_size: int, val_fraction: float, encoded: bool = False
) -> tuple[Samples, dict[str, Any]]:
    """WebDataset tar shards (a .tar file, or a folder of them read in name order)."""
    wds = _need("webdataset")
    urls = [str(path)] if path.is_file() else [str(p) for p in sorted(path.glob("*.tar"))]
    header = _image_header(image_size, encoded, 0, {"name": "webdataset", "path": str(path),
                                                    "shards": len(urls)}, val_fraction)  # fmt: skip

    def items(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        for sid, sample in enumerate(wds.WebDataset(urls, shardshuffle=False, empty_check=False)):
            key = str(sample["__key__"])
            where = f"sample {key!r} of {sample.get('__url__', path)}"
            image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
            if image is None or "cls" not in sample:
                raise DataError(
                    f"{where} has no image ({', '.join(IMAGE_KEYS)}) and class (cls) entry; "
                    "write each sample as KEY.jpg (or .png) and KEY.cls."
                )
            try:
                label = int(bytes(sample["cls"]).decode().strip())
            except ValueError:
                raise DataError(f"{where}: its cls entry is not a class number.") from None
            if label < 0:
                raise DataError(f"{where}: its class {label} is negative; classes are 0..C-1.")
            header["num_classes"] = max(header["num_classes"], label + 1)
            if _val(key, val_fraction) == (split == "val"):
                x = _image_sample(bytes(image), image_size, encoded, where)
                yield sid, x, np.asarray(label, dtype=np.int64)

    return {"train": items("train"), "val": items("val")}, header


def from_hf_disk(
    path: Path,
    label: str,
    image_size: int,
    val_fraction: float,
    encoded: bool = False,
    features: list[str] | None = None,
    fill: float | None = None,
    seq_len: int = 256,
    eot: int = 0,
) -> tuple[Samples, dict[str, Any]]:
    """A Hugging Face `datasets` folder written by `save_to_disk`: token documents (an
    `input_ids` column) packed into windows, images, or numeric columns."""
    hf = _need("datasets")
    try:
        loaded = hf.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(f"{path} cannot be read as a saved `datasets` folder ({exc}).") from None
    parts = dict(loaded) if isinstance(loaded, hf.DatasetDict) else {"train": loaded}
    if "train" not in parts:
        raise DataError(f"{path} has the splits {', '.join(parts)} but no 'train' split.")
    train = parts["train"]
    val = parts.get("validation", parts.get("test"))
    feats = train.features
    if TOKENS_COLUMN in feats:
        return _packed(path, parts, val, seq_len, eot, val_fraction)
    if label not in feats:
        raise DataError(
            f"{path} has no column {label!r} (columns: {', '.join(feats)}); pass the label "
            "column with --label."
        )
    labels = np.asarray(train[label])
    if labels.dtype == object or not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise DataError(f"column {label!r} of {path} must hold class numbers 0..C-1.")
    names = list(getattr(feats[label], "names", None) or [])
    num_classes = len(names) or int(labels.max()) + 1
    images = [n for n, f in feats.items() if isinstance(f, hf.Image)]
    source = {"name": "hf_datasets", "path": str(path), "rows": len(train)}
    if images:
        header = _image_header(image_size, encoded, num_classes, source, val_fraction)
        col = images[0]
        parts = {k: v.cast_column(col, hf.Image(decode=False)) for k, v in parts.items()}

        def x_of(row: dict[str, Any], where: str) -> np.ndarray:
            image = row[col]
            data = image["bytes"] if image.get("bytes") else Path(image["path"]).read_bytes()
            return _image_sample(data, image_size, encoded, where)
    else:
        cols = _numeric_columns(path, feats, label, features, hf)
        header = {
            "sample": {"layout": "tensor", "x": shards.spec(np.float32, (len(cols),)),
                       "y": shards.spec(np.int64, ())},
            "num_classes": num_classes,
            "features": cols,
            "source": source,
            "transform": {"write": {"features": cols, "label": label, "dtype": "float32",
                                    **({} if fill is None else {"fill": fill})},
                          "val_fraction": val_fraction, "read": {}},
        }  # fmt: skip
        if fill is not None and not math.isfinite(fill):
            raise DataError(f"--fill {fill} must be a finite number.")

        def x_of(row: dict[str, Any], where: str) -> np.ndarray:
            values = [row[c] for c in cols]
            for c, v in zip(cols, values, strict=True):
                if v is None and fill is None:
                    raise DataError(
                        f"column {c!r} of {where} is empty (null); fill it in the data, or "
                        "pass --fill VALUE to write VALUE in its place."
                    )
            return np.asarray([fill if v is None else v for v in values], dtype=np.float32)

    if names:
        header["classes"] = names

    def rows(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        ds = parts["train"] if split == "train" or val is None else val
        offset = 0 if ds is parts["train"] else len(parts["train"])
        for i, row in enumerate(ds):
            if val is None and _val(str(i), val_fraction) != (split == "val"):
                continue
            where = f"row {i} of {path} ({split})"
            yield offset + i, x_of(row, where), np.asarray(int(row[label]), dtype=np.int64)

    return {"train": rows("train"), "val": rows("val")}, header


def _pack(docs: Iterator[Any], seq: int, eot: int, where: str) -> Iterator[np.ndarray]:
    """Windows of seq + 1 tokens, stride seq (as data.source tokens reads a token file), over
    the documents one after another, each followed by `eot`: no padding, and a document longer
    than a window runs on into the next. The last partial window is dropped."""
    buf = np.empty(0, np.int64)
    for i, doc in enumerate(docs):
        ids = np.asarray(doc, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.uint16).max):
            raise DataError(
                f"document {i} of {where} has token ids outside 0..65535, which shards store "
                "as uint16; use a vocabulary of at most 65,536 tokens."
            )
        buf = np.concatenate([buf, ids, [eot]])
        while buf.size >= seq + 1:
            yield buf[: seq + 1].astype(np.uint16)
            buf = buf[seq:]


def _packed(path: Path, parts: dict[str, Any], val: Any, seq: int, eot: int,
            val_fraction: float) -> tuple[Samples, dict[str, Any]]:  # fmt: skip
    if not 0 <= eot <= np.iinfo(np.uint16).max:
        raise DataError(f"--eot {eot} must be a token id in 0..65535.")
    header: dict[str, Any] = {
        "sample": {"layout": "tokens", "x": shards.spec(np.uint16, (seq + 1,)),
                   "y": shards.spec(np.int64, ())},
        "num_classes": eot + 1,
        "seq_len": seq,
        "source": {"name": "hf_datasets", "path": str(path), "documents": len(parts["train"])},
        "transform": {"windows": "documents packed, each followed by eot; seq_len + 1 tokens, "
                      "stride seq_len", "eot": eot, "val_fraction": val_fraction, "read": {}},
    }  # fmt: skip

    def docs(split: str) -> Iterator[Any]:
        ds = parts["train"] if split == "train" or val is None else val
        for i, row in enumerate(ds.select_columns([TOKENS_COLUMN])):
            if val is None and _val(str(i), val_fraction) != (split == "val"):
                continue
            yield row[TOKENS_COLUMN]

    def windows(split: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        for k, w in enumerate(_pack(docs(split), seq, eot, f"{path} ({split})")):
            header["num_classes"] = max(header["num_classes"], int(w.max()) + 1)  # the vocab
            yield k, w, np.zeros((), np.int64)

    return {"train": windows("train"), "val": windows("val")}, header


def _numeric_columns(
    path: Path, feats: Any, label: str, features: list[str] | None, hf: Any
) -> list[str]:
    names = features if features is not None else [n for n in feats if n != label]
    for n in names:
        f = feats.get(n)
        dtype = getattr(f, "dtype", None) if isinstance(f, hf.Value) else None
        ok = dtype is not None and (dtype == "bool" or dtype.startswith(("int", "uint", "float")))
        if n == label or f is None or not ok:
            raise DataError(
                f"column {n!r} of {path} is {'the label' if n == label else f}, not a number "
                "column; name the feature columns with --features (comma-separated)."
            )
    if not names:
        raise DataError(f"{path} has no feature columns besides {label!r}.")
    return names


def export_webdataset(folder: str | Path, out: Path, split: str, maxcount: int) -> dict[str, Any]:
    """Write split `split` of a shard set as WebDataset tar shards of at most `maxcount`
    samples: an image set's stored pixels as KEY.png, other inputs as KEY.npy (numpy's format,
    read without pickle), a class number as KEY.cls, any other target as KEY.target.npy."""
    wds = _need("webdataset")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} already exists and is not an empty folder; pass a new one.")
    out.mkdir(parents=True, exist_ok=True)
    data = shards.ShardSet(folder, split, raw=True)
    image = data.layout in ("tensor", "encoded") and len(data.x_shape) == 3
    image = image and data.x_dtype == np.uint8
    with wds.ShardWriter(str(out / f"{split}-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in range(len(data)):
            x, y = (t.numpy() for t in data[i])
            sample: dict[str, Any] = {"__key__": f"{i:09d}"}
            if image:
                sample["png"] = _png(x)
            else:
                sample["npy"] = x
            if y.ndim == 0:
                sample["cls"] = int(y)
            else:
                sample["target.npy"] = y
            sink.write(sample)
    tars = sorted(p.name for p in out.glob("*.tar"))
    return {"out": str(out), "split": split, "samples": len(data), "shards": tars}


def _png(chw: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0))).save(buf, format="PNG")
    return buf.getvalue()
