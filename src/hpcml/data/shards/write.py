"""Writing a shard set: Arrow IPC shards of about `--shard-size` each, then the manifest
(written last, atomically). The format is described in `hpcml.data.shards`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.data.shards.hash_cache import sha256_of as sha256_file
from hpcml.data.shards.manifest import COMPRESSIONS, FORMAT, MANIFEST
from hpcml.errors import DataError

ENCODED_ROWS = 64
"""Samples per record batch of an encoded set (each an image file's bytes)."""


def parse_size(text: str) -> int:
    """'64MB', '512KiB', '1GB' or a number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = text.strip().upper()
    num = s.rstrip("KMGIB")
    unit = s[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise DataError(
            f"--shard-size {text!r} is not a size; write e.g. 64MB, 512KiB or a number of bytes."
        ) from None
    if value < 1:
        raise DataError(f"--shard-size {text!r} must be at least 1 byte.")
    return int(value)


class ShardWriter:
    """Writes one split's samples into shards of about `shard_bytes` of sample data each."""

    def __init__(
        self,
        root: Path,
        split: str,
        x_spec: tuple[np.dtype[Any], tuple[int, ...]],
        y_spec: tuple[np.dtype[Any], tuple[int, ...]],
        shard_bytes: int,
        compression: str,
        encoded: bool = False,
    ) -> None:
        self.root, self.split, self.compression = root, split, compression
        self.encoded, self.shard_bytes, self._bytes = encoded, shard_bytes, 0
        """Encoded: x is a file's bytes as they are (variable size); a shard closes once it
        holds `shard_bytes` of them, and record batches hold ENCODED_ROWS samples."""
        self.x_width = int(np.prod(x_spec[1], dtype=np.int64)) * x_spec[0].itemsize
        self.y_width = int(np.prod(y_spec[1], dtype=np.int64)) * y_spec[0].itemsize
        self.per_shard = max(1, shard_bytes // (self.x_width + self.y_width))
        # Compressed batches are decompressed whole on a read: keep them near 64 KiB.
        self.rows_per_batch = (
            max(1, 65536 // self.x_width) if compression != "none" else self.per_shard
        )
        if encoded:
            self.per_shard, self.rows_per_batch = 2**62, ENCODED_ROWS
        self.x_spec, self.y_spec = x_spec, y_spec
        self.shards: list[dict[str, Any]] = []
        self._ids: list[int] = []
        self._xs: list[bytes] = []
        self._ys: list[bytes] = []

    def add(self, sid: int, x: np.ndarray, y: np.ndarray) -> None:
        self._ids.append(sid)
        xb = x.tobytes() if self.encoded else np.ascontiguousarray(x, self.x_spec[0]).tobytes()
        self._xs.append(xb)
        self._ys.append(np.ascontiguousarray(y, dtype=self.y_spec[0]).tobytes())
        self._bytes += len(xb)
        if len(self._ids) >= self.per_shard or (self.encoded and self._bytes >= self.shard_bytes):
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if not self._ids:
            return
        n = len(self._ids)
        table = pa.table(
            {
                "id": pa.array(self._ids, type=pa.int64()),
                "x": pa.array(self._xs, type=pa.binary(-1 if self.encoded else self.x_width)),
                "y": pa.array(self._ys, type=pa.binary(self.y_width)),
            }
        )
        name = f"{self.split}-{len(self.shards):05d}.arrow"
        path = self.root / name
        codec = None if self.compression == "none" else self.compression
        options = pa.ipc.IpcWriteOptions(compression=codec)
        with (
            pa.OSFile(str(path), "wb") as sink,
            pa.ipc.new_file(sink, table.schema, options=options) as writer,
        ):
            writer.write_table(table, max_chunksize=self.rows_per_batch)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        self.shards.append(
            {
                "file": name,
                "samples": n,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
                "first_id": self._ids[0],
            }
        )
        self._ids, self._xs, self._ys, self._bytes = [], [], [], 0

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {
            "samples": sum(s["samples"] for s in self.shards),
            "rows_per_batch": self.rows_per_batch,
            "shards": self.shards,
        }


def spec(dtype: Any, shape: Iterable[int]) -> dict[str, Any]:
    return {"dtype": np.dtype(dtype).str, "shape": [int(s) for s in shape]}


def write_shard_set(
    out: Path,
    samples: dict[str, Iterator[tuple[int, np.ndarray, np.ndarray]]],
    header: dict[str, Any],
    shard_bytes: int,
    compression: str,
) -> dict[str, Any]:
    """Write `samples[split]` (id, x, y) into `out` and return the manifest (written last,
    atomically: a folder without a manifest is not a shard set). `header` holds format-level
    facts: sample spec, source, transform, classes."""
    if compression not in COMPRESSIONS:
        raise DataError(
            f"--compression {compression!r} is not known; use one of {', '.join(COMPRESSIONS)}."
        )
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(
            f"--out {out} already exists and is not an empty folder; pass a new folder "
            "(shard sets are never overwritten)."
        )
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--out {out} cannot be created ({exc.strerror or exc}).") from None
    sample = header["sample"]
    x_spec = (np.dtype(sample["x"]["dtype"]), tuple(sample["x"]["shape"]))
    y_spec = (np.dtype(sample["y"]["dtype"]), tuple(sample["y"]["shape"]))
    splits: dict[str, Any] = {}
    try:
        for split, items in samples.items():
            encoded = sample["layout"] == "encoded"
            writer = ShardWriter(out, split, x_spec, y_spec, shard_bytes, compression, encoded)
            for sid, x, y in items:
                writer.add(sid, x, y)
            splits[split] = writer.summary()
    except BaseException:
        for p in out.iterdir():  # only files this call wrote: the folder was empty
            p.unlink()
        if created:
            out.rmdir()
        raise
    manifest = {"format": FORMAT, **header, "compression": compression, "splits": splits}
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_bytes(json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
    tmp.replace(out / MANIFEST)
    return manifest
