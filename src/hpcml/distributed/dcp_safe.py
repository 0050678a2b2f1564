"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it.

DCP's own reader unpickles `.metadata` with `pickle.load`, and its default load planner reads
every non-tensor entry (optimizer hyperparameters, trainer state) with
`torch.load(weights_only=False)`: a crafted checkpoint folder would run code on `--resume`.
No DCP option turns either off (torch 2.13), so this module supplies the two pieces DCP lets a
caller replace:

- `SafeFileSystemReader`: `.metadata` is read by an unpickler that only builds DCP's own
  metadata classes, torch sizes, dtypes and layouts, and paths; any other global in the file
  ends in a `CheckpointError` naming it, and nothing is called.
- `SafeLoadPlanner`: non-tensor entries load with `torch.load(weights_only=True)`.

`SealedFileSystem` is DCP's file system with every file encrypted at rest (`encryption` in the
run config): `sealed_writer` writes a checkpoint through it, and `reader` reads one through it
when its `.metadata` is sealed.

Tensors were already read with `weights_only=True` by DCP itself.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import ReadItem

from hpcml import crypt
from hpcml.errors import CheckpointError

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # getattr(torch, "strided"): a name lookup only
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint metadata {self.where} names {module}.{name}, which is not part of a "
            "checkpoint's description; it was not unpickled. Use a checkpoint this tool wrote."
        )


def read_metadata_file(stream: Any, where: str) -> dcp_metadata.Metadata:
    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled file, said in one sentence
        raise CheckpointError(
            f"checkpoint metadata {where} cannot be read ({type(exc).__name__}); the checkpoint "
            "is damaged: resume from an earlier one."
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(
            f"checkpoint metadata {where} holds a {type(metadata).__name__}, not a checkpoint "
            "description; the checkpoint is damaged: resume from an earlier one."
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_metadata_file(f, str(path))
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner with non-tensor entries read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn} holds more than plain data "
                f"({str(exc).splitlines()[0][:160]}); it was not unpickled. Use a checkpoint "
                "this tool wrote."
            ) from None
        super().load_bytes(read_item, io.BytesIO(_reserialize(obj)))


def _reserialize(obj: Any) -> bytes:
    # DefaultLoadPlanner.load_bytes places the value (flattened or not); handing it a buffer
    # that holds only what the safe load produced keeps that logic DCP's own.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class SealedFileSystem(FileSystem):
    """DCP's local file system with every file sealed (AES-GCM, `hpcml.crypt`) as a whole:
    a written stream is encrypted and fsynced when closed, a read one decrypted into memory
    (DCP seeks within it by the offsets its metadata records)."""

    def __init__(self, key: crypt.Key) -> None:
        super().__init__()
        self.key = key

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        path = Path(path)
        if "r" in mode:
            yield io.BytesIO(crypt.unseal(path.read_bytes(), self.key, str(path)))
            return
        buf = _Buffer()
        yield buf
        crypt.write_sealed(path, buf.contents(), self.key)


class _Buffer(io.BytesIO):
    """What DCP writes into. DCP closes a data file's stream itself, inside the stream's
    context: its bytes are kept on close to be sealed when the context ends."""

    kept: bytes | None = None

    def close(self) -> None:
        if not self.closed:
            self.kept = self.getvalue()
        super().close()

    def contents(self) -> bytes:
        return self.kept if self.closed and self.kept is not None else self.getvalue()


def sealed_writer(path: str, key: crypt.Key, writer: FileSystemWriter | None = None) -> Any:
    """`writer` (a new FileSystemWriter by default) writing sealed files; its own fsync (which
    would be os.sync() on a memory stream) is off: each sealed file is fsynced as written."""
    writer = writer if writer is not None else FileSystemWriter(path)
    writer.fs = SealedFileSystem(key)
    writer.sync_files = False
    return writer


def reader(path: str | Path, key: crypt.Key | None = None) -> SafeFileSystemReader:
    """The safe reader of the checkpoint at `path`; one whose files are sealed reads them with
    `key` (or the environment's), refused in one sentence without the key it was written with."""
    r = SafeFileSystemReader(str(path))
    meta = Path(path) / ".metadata"
    if meta.is_file() and crypt.file_is_sealed(meta):
        key = key or crypt.key_from_env(required_for=f"checkpoint {path}")
        assert key is not None
        with open(meta, "rb") as f:
            crypt.check_key(f.read(crypt.HEADER_BYTES), key, str(meta))
        r.fs = SealedFileSystem(key)
    return r


def read_metadata(path: str | Path, key: crypt.Key | None = None) -> dcp_metadata.Metadata:
    """The checkpoint's `.metadata`, read by the allow-list unpickler."""
    return reader(path, key).read_metadata()


def load(
    state: dict[str, Any], path: str | Path, key: crypt.Key | None = None, **kwargs: Any
) -> None:
    """`dcp.load` with the safe reader and planner. The metadata is checked first, so a crafted
    one ends in its own sentence; a crafted entry found during the load is unwrapped from DCP's
    CheckpointException (a BaseException carrying every rank's failure) into that sentence."""
    read_metadata(path, key)
    try:
        dcp.load(
            state,
            storage_reader=reader(path, key),
            planner=SafeLoadPlanner(),
            **kwargs,
        )
    except CheckpointException as exc:
        for inner, _trace in exc.failures.values():  # (exception, traceback) per rank
            if isinstance(inner, CheckpointError):
                raise inner from None
        raise


__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SealedFileSystem",
    "load",
    "read_metadata",
    "reader",
    "sealed_writer",
]
