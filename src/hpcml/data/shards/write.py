"""Writing a shard set: Arrow IPC shards of about `--shard-size` each, then the manifest
(written last, atomically). The format is described in `hpcml.data.shards`."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.data.arrow_shard import write_shard
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
        pool: Executor | None = None,
        ahead: int = 2,
        key: Any = None,
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
        self.key = key
        """An `hpcml.crypt.Key`: each shard file is sealed with it (`--encrypt`)."""
        self.shards: list[dict[str, Any]] = []
        self.pool = pool
        """Writer processes (`--workers`): a full shard's samples go to one of them, and the
        manifest's entries come back in shard order; at most `ahead` shards wait in memory."""
        self.ahead = ahead
        self._pending: list[Future[dict[str, Any]]] = []
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
        if not self._ids:
            return
        name = f"{self.split}-{len(self.shards) + len(self._pending):05d}.arrow"
        job = functools.partial(
            write_shard, str(self.root / name), self._ids, self._xs, self._ys,
            (self.x_width, self.y_width), self.encoded, self.rows_per_batch, self.compression,
            self.key,
        )  # fmt: skip
        self._ids, self._xs, self._ys, self._bytes = [], [], [], 0
        if self.pool is None:
            self.shards.append(job())
            return
        self._pending.append(self.pool.submit(job))
        while len(self._pending) > self.ahead:
            self.shards.append(self._pending.pop(0).result())

    def summary(self) -> dict[str, Any]:
        self.flush()
        while self._pending:
            self.shards.append(self._pending.pop(0).result())
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
    workers: int = 1,
    key: Any = None,
) -> dict[str, Any]:
    """Write `samples[split]` (id, x, y) into `out` and return the manifest (written last,
    atomically: a folder without a manifest is not a shard set). `header` holds format-level
    facts: sample spec, source, transform, classes. With `workers` > 1 the shard files are
    written (serialized, compressed, synced, hashed) by that many spawned processes while this
    one reads the source; the files and the manifest are byte for byte the serial writer's.
    With `key` every shard file is sealed (hpcml.crypt); the manifest stays readable and holds
    the sealed files' sha256."""
    if compression not in COMPRESSIONS:
        raise DataError(
            f"--compression {compression!r} is not known; use one of {', '.join(COMPRESSIONS)}."
        )
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1 (processes writing shards).")
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
    encoded = sample["layout"] == "encoded"
    try:
        with _writers(workers) as pool:
            for split, items in samples.items():
                writer = ShardWriter(
                    out, split, x_spec, y_spec, shard_bytes, compression, encoded, pool, 2 * workers,
                    key,
                )  # fmt: skip
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
    if key is not None:
        manifest["encryption"] = "aes-256-gcm"
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_bytes(json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
    tmp.replace(out / MANIFEST)
    return manifest


def _writers(workers: int) -> Any:
    """A pool of `workers` spawned writer processes, or a no-op context for one."""
    import contextlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if workers == 1:
        return contextlib.nullcontext(None)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
