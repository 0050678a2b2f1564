"""One shard file of a shard set (`hpcml.data.shards`): its samples written as an Arrow IPC
file, synced, and described (name, samples, bytes, sha256, first id) for the manifest.

A module outside the `hpcml.data.shards` package, whose import loads torch, so that the writer
processes of `hpcml data shard --workers N` (spawned, not forked: the writing process may hold
pyarrow's and torch's threads) start with numpy and pyarrow alone."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def write_shard(
    path: str,
    ids: list[int],
    xs: list[bytes],
    ys: list[bytes],
    widths: tuple[int, int],
    encoded: bool,
    rows_per_batch: int,
    compression: str,
    key: Any = None,
) -> dict[str, Any]:
    """Write the samples (ids, x bytes, y bytes) to `path` in record batches of
    `rows_per_batch` rows; x is variable-size binary when `encoded`, else `widths[0]` bytes.
    With `key` (an `hpcml.crypt.Key`) the file is sealed (AES-GCM) as a whole."""
    import pyarrow as pa

    table = pa.table(
        {
            "id": pa.array(ids, type=pa.int64()),
            "x": pa.array(xs, type=pa.binary(-1 if encoded else widths[0])),
            "y": pa.array(ys, type=pa.binary(widths[1])),
        }
    )
    codec = None if compression == "none" else compression
    options = pa.ipc.IpcWriteOptions(compression=codec)
    if key is not None:
        from hpcml import crypt

        memory = pa.BufferOutputStream()
        with pa.ipc.new_file(memory, table.schema, options=options) as writer:
            writer.write_table(table, max_chunksize=rows_per_batch)
        crypt.write_sealed(Path(path), memory.getvalue().to_pybytes(), key)  # fsynced
    else:
        with (
            pa.OSFile(path, "wb") as sink,
            pa.ipc.new_file(sink, table.schema, options=options) as writer,
        ):
            writer.write_table(table, max_chunksize=rows_per_batch)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return {
        "file": Path(path).name,
        "samples": len(ids),
        "bytes": os.stat(path).st_size,
        "sha256": sha256_of(Path(path)),
        "first_id": ids[0],
    }


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):  # 4 MiB at a time: bounded memory
            h.update(chunk)
    return h.hexdigest()
