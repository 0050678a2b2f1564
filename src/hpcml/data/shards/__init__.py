"""Shard sets: a folder of Arrow IPC files plus a manifest, read by sample index.

Why this format and not a shard library. hpcml already owns the elastic position: the order of
an epoch is a function of (seed, epoch) alone (DistributedSampler's permutation) and a
checkpoint stores the global sample position, so a resume on another world size or worker
count continues at the next unseen sample (`hpcml.data.loader`). What the shards must give is
therefore random access by sample index with bounded memory. LitData and MosaicML Streaming
(and its fork streaming-community) each bring their own iterable dataset whose order comes from
their own partitioning of chunks over workers and ranks, and their own checkpoint keys, so using
them means replacing the engine's position with theirs. LitData's tracker shows a run of resume
bugs in exactly that machinery (Lightning-AI/litData #24 "resuming with num_workers=0 fails",
closed won't-fix; #248 multi-node resume; #316, #770). Streaming's elastic determinism is tied
to `num_canonical_nodes`, it keeps state in shared memory and file locks, its loader imports
transformers, and upstream mosaicml-streaming pins numpy<2.2 (this environment has numpy 2.4;
pip silently falls back to 0.10). WebDataset reads tar files sequentially (random access only
through the separate `wids` index). Arrow IPC files, written and memory-mapped by the
already-installed pyarrow, give exactly random access by row: an uncompressed shard is read
zero-copy through the page cache, a compressed one (lz4/zstd) one small record batch at a time.
The format is documented here and in the README; nothing in it is executed or unpickled.

Layout of a shard set folder::

    manifest.json            format, source, transform, sample spec, per-shard sha256 + counts
    train-00000.arrow ...    columns: id (int64), x (fixed-size binary), y (fixed-size binary)
    val-00000.arrow ...

The version id of a shard set is the sha256 of its canonical manifest JSON (which holds every
shard's sha256), so two shard sets with the same id hold the same bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hpcml.data.device_augment import normalize_pixels
from hpcml.data.shards.cache import DiskCache
from hpcml.data.shards.crop import random_resized_crop
from hpcml.data.shards.manifest import (
    MANIFEST,
    SPLITS,
    check_shard,
    read_manifest,
)
from hpcml.data.shards.manifest import canonical as canonical  # re-exported: the version id's input
from hpcml.data.shards.manifest import version_id as version_id
from hpcml.data.shards.order import shard_stream_order, shard_window_order
from hpcml.data.shards.readahead import ShardSlots
from hpcml.data.shards.store import Store, is_remote, open_ipc
from hpcml.errors import DataError


def verify(
    folder: str | Path,
    manifest: dict[str, Any],
    splits: Iterable[str] = SPLITS,
    deep: bool | None = None,
    shared: bool = False,
) -> None:
    """Every shard of `splits` exists with the size the manifest records and, when `deep`, the
    sha256; a local set's shards also have the columns and rows it records. By default deep for
    a local folder; for a remote set only sizes are checked here, since every shard's sha256 is
    checked when it is read (`Store.open_shard`). `shared` (`data.verify: full` in training):
    the hashing is split over the ranks of the process group, each hashing its share once, and
    a local file's digest is remembered while the file is unchanged (`hpcml.data.shards.hash_cache`)."""
    store = Store(folder)
    deep = not store.remote if deep is None else deep
    manifest_at = store.describe(MANIFEST)
    entries = [s for split in splits for s in manifest["splits"].get(split, {}).get("shards", [])]
    for shard in entries:
        size = store.size(shard["file"])
        if size is None:
            raise DataError(
                f"shard {store.describe(shard['file'])} named in {manifest_at} is missing; copy "
                "the whole shard set again or write it anew."
            )
        if size != shard["bytes"]:
            _changed(store, shard["file"], manifest_at)
    if deep:
        names = [s["file"] for s in entries]
        if shared:
            from hpcml.data.shards.hash_cache import HashCache
            from hpcml.distributed.runtime import split_work

            cache = HashCache()
            hash_one = (
                (lambda n: cache.sha256(store.root / n)) if not store.remote else store.sha256
            )
            digests = split_work(names, hash_one)
        else:
            digests = [store.sha256(n) for n in names]
        for shard, digest in zip(entries, digests, strict=True):
            if digest != shard["sha256"]:
                _changed(store, shard["file"], manifest_at)
    if not store.remote:  # a remote shard's rows are checked when it is read
        check_rows(store, manifest, splits)


def _changed(store: Store, name: str, manifest_at: str) -> None:
    raise DataError(
        f"shard {store.describe(name)} does not match the sha256 in {manifest_at} (corrupted "
        "or changed after writing); copy the shard set again or write it anew."
    )


def check_rows(store: Store, manifest: dict[str, Any], splits: Iterable[str] = SPLITS) -> None:
    """Every shard of a local set has the columns and rows its manifest says (from each file's
    Arrow metadata: a footer and one record batch per shard)."""
    import pyarrow as pa

    for split in splits:
        for k, shard in enumerate(manifest["splits"].get(split, {}).get("shards", [])):
            where = store.describe(shard["file"])
            try:
                reader = open_ipc(where)
            except (OSError, pa.ArrowInvalid) as exc:
                raise DataError(f"shard {where} cannot be read ({exc}); write it again.") from None
            check_shard(reader, manifest, split, k, where)


# ---------------------------------------------------------------- reading


class ShardSet(Dataset[Any]):
    """Map-style dataset over one split of a shard set: item i is sample i of the split.

    At most `cache_shards` shard files are open (memory-mapped) per reading process; the least
    recently used one is closed when another is needed, so the address space and resident
    memory the reader holds are bounded by about `cache_shards` shards whatever the data size.
    With `with_ids` items carry the stored sample id as a third element (tests, lineage).

    Remote sets: `cache_dir` keeps downloaded shards on local disk (`hpcml.data.shards.cache`);
    `readahead` shards (default 1 remote, 0 local) are fetched in a background thread while the
    current one is read (`hpcml.data.shards.readahead`): within a batch (`__getitems__`, what the
    DataLoader calls), the batch's next shards in the order it reads them, a batch read shard
    by shard and returned in its own order; one sample at a time (`__getitem__`), the shards
    after a newly opened one in file order, which is the reading order of an unshuffled pass.
    """

    def __init__(
        self,
        folder: str | Path,
        split: str,
        manifest: dict[str, Any] | None = None,
        cache_shards: int = 4,
        with_ids: bool = False,
        raw: bool = False,
        cache_dir: str | Path | None = None,
        cache_limit_bytes: int = 10 * 10**9,
        readahead: int | None = None,
        shuffle_shards: int | None = None,
        crop: tuple[float, float] | None = None,
    ) -> None:
        self._store_args = (str(folder), cache_dir, cache_limit_bytes)
        self.store = _store(*self._store_args)
        self.root = self.store.describe()
        self.manifest = manifest or read_manifest(folder)
        entry = self.manifest["splits"].get(split)
        if entry is None or not entry["shards"]:
            raise DataError(f"shard set {self.root} has no {split!r} samples; write it again.")
        self.split = split
        self.files = [s["file"] for s in entry["shards"]]
        self.sha256 = [s["sha256"] for s in entry["shards"]]
        self.sizes = [int(s["bytes"]) for s in entry["shards"]]
        counts = [int(s["samples"]) for s in entry["shards"]]
        self.counts = counts
        self.shuffle_shards = shuffle_shards
        """Shards a shuffled epoch mixes at a time (`hpcml.data.shards.order`); None: all of them."""
        self.starts = list(np.cumsum([0, *counts])[:-1].tolist())
        self.length = int(sum(counts))
        self.rows_per_batch = int(entry["rows_per_batch"])
        sample = self.manifest["sample"]
        self.layout = sample["layout"]
        self.x_dtype, self.x_shape = np.dtype(sample["x"]["dtype"]), tuple(sample["x"]["shape"])
        self.y_dtype, self.y_shape = np.dtype(sample["y"]["dtype"]), tuple(sample["y"]["shape"])
        self.transform = self.manifest.get("transform", {}).get("read", {})
        self.cache_shards = cache_shards
        self.readahead = (1 if self.store.remote else 0) if readahead is None else readahead
        self.with_ids = with_ids
        self.raw = raw
        """Inputs as stored (uint8 pixels), the read transform left to the device."""
        self.crop = crop
        """Encoded images: the area share range of a random-resized-crop at the stored
        resolution (`hpcml.data.shards.crop`), drawn per (seed, epoch, index) key: the loader
        then passes keys (`epoch_keyed`)."""
        self.epoch_keyed = crop is not None
        self._batch: tuple[int, int, Any] | None = None
        self.slots = self._slots()

    def _slots(self) -> ShardSlots:
        return ShardSlots(self._open_shard, self.cache_shards, self.readahead, self._evicted)

    def _evicted(self, k: int) -> None:
        if self._batch is not None and self._batch[0] == k:
            self._batch = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:  # workers open their own maps and clients
        state = {**self.__dict__, "_batch": None}
        del state["store"], state["slots"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.store = _store(*self._store_args)
        self.slots = self._slots()

    def _open_shard(self, k: int) -> Any:
        import pyarrow as pa

        path = self.store.describe(self.files[k])
        try:
            reader = self.store.open_shard(self.files[k], self.sha256[k], self.sizes[k])
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(
                f"shard {path} cannot be read ({exc}); check the shard set with "
                f"`hpcml data info {self.root} --verify`, or lower data.shard_cache if memory "
                "is short."
            ) from None
        check_shard(reader, self.manifest, self.split, k, path)
        return reader

    def _reader(self, k: int, ahead: bool = True) -> Any:
        first_use = not self.slots.is_open(k)
        reader = self.slots.get(k)
        if first_use and ahead:  # one sample at a time: guess the file order
            self.slots.prefetch(range(k + 1, min(k + 1 + self.readahead, len(self.files))), k)
        return reader

    dealt = True
    """The loader deals a shuffled epoch to its reading processes, a piece each
    (`hpcml.data.shards.order.dealt_order`)."""

    @property
    def has_epoch_order(self) -> bool:
        """A shuffled epoch takes `epoch_order` (a window of shards) over one permutation."""
        return self.shuffle_shards is not None

    def epoch_order(self, seed: int, epoch: int, pieces: list[int] | None = None) -> np.ndarray:
        """The shuffled order of one epoch, `shuffle_shards` shards at a time; with `pieces`,
        laid out in pieces of those lengths that each hold whole shards but at their ends, one
        piece per reading process (`hpcml.data.shards.order.shard_stream_order`)."""
        window = self.shuffle_shards or len(self.counts)
        if pieces is None:
            return shard_window_order(self.counts, window, seed, epoch)
        return shard_stream_order(self.counts, window, seed, epoch, pieces)

    def shard_of(self, i: int) -> int:
        return bisect.bisect_right(self.starts, i) - 1

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        """Samples `indices` (or (seed, epoch, index) keys), in that order, read shard by shard:
        while one shard's samples are read the batch's next shards are fetched ahead."""
        by_shard: dict[int, list[int]] = {}
        for pos, key in enumerate(indices):
            i = _index(key)
            if not 0 <= i < self.length:
                raise IndexError(i)
            by_shard.setdefault(self.shard_of(i), []).append(pos)
        order = list(by_shard)
        out: list[Any] = [None] * len(indices)
        for n, k in enumerate(order):
            self._reader(k, ahead=False)
            self.slots.prefetch(order[n + 1 :], k)
            for pos in by_shard[k]:
                out[pos] = self[indices[pos]]
        return out

    def _row(self, i: int) -> tuple[memoryview, memoryview, int]:
        k = self.shard_of(i)
        row = i - self.starts[k]
        b, j = divmod(row, self.rows_per_batch)
        if self._batch is not None and self._batch[:2] == (k, b):
            batch = self._batch[2]
        else:
            batch = self._reader(k).get_batch(b)
            self._batch = (k, b, batch)
        ids, xs, ys = batch.column(0), batch.column(1), batch.column(2)
        return _cell(xs, j), _cell(ys, j), int(ids[j].as_py())

    def __getitem__(self, key: Any) -> Any:
        i = _index(key)
        if not 0 <= i < self.length:
            raise IndexError(i)
        xb, yb, sid = self._row(i)
        if self.layout == "encoded":  # an image file's bytes: decoded here, in the worker
            x = self._decode_image(xb, sid, key)
        else:
            x = np.frombuffer(xb, dtype=self.x_dtype).reshape(self.x_shape)
        y = np.frombuffer(yb, dtype=self.y_dtype).reshape(self.y_shape)
        xt, yt = self._decode(x, y)
        return (xt, yt, sid) if self.with_ids else (xt, yt)

    def _decode_image(self, data: memoryview, sid: int, key: Any) -> np.ndarray:
        """(3, H, W) uint8 pixels of a stored image file, converted and resized as the manifest's
        `transform.read.decode` says (the same Pillow calls as resizing at write time), or a
        random-resized-crop of it with `crop` (a plain index counts as seed 0, epoch 0)."""
        h, w = self.x_shape[1:]
        try:
            if self.crop is None:
                return decode_rgb(data, h, w)
            seed, epoch, i = key if isinstance(key, tuple) else (0, 0, int(key))
            rng = np.random.default_rng([seed % 2**63, epoch, i, CROP_STREAM])
            return random_resized_crop(data, h, w, self.crop, rng)
        except ValueError as exc:
            raise DataError(
                f"sample {sid} of shard set {self.root} is not a readable image "
                f"({exc}); write the shard set again from good images."
            ) from None

    def _decode(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == "tokens":  # one stored window of seq_len + 1 tokens
            w = torch.from_numpy(x.astype(np.int64))
            return w[:-1], w[1:]
        t = self.transform
        if self.raw or (x.dtype == np.uint8 and is_pixel_transform(t)):
            xt = torch.from_numpy(x.copy())
            if not self.raw:
                xt = normalize_pixels(xt, float(t["scale"]), tuple(t["mean"]), tuple(t["std"]))
        else:
            xt = torch.from_numpy(x.astype(np.float32) if x.dtype != np.float32 else x.copy())
            if "scale" in t:
                xt = xt * float(t["scale"])
            if "mean" in t:
                shape = (-1,) + (1,) * (xt.dim() - 1)
                mean = torch.tensor(t["mean"], dtype=torch.float32).view(shape)
                std = torch.tensor(t["std"], dtype=torch.float32).view(shape)
                xt = (xt - mean) / std
        yt = torch.from_numpy(y.astype(np.int64))
        return xt, (yt.reshape(()) if self.y_shape in ((), (1,)) else yt)


CROP_STREAM = 0x63726F70
"""Salts the crop's generator apart from data.augment's, which is seeded with the same key."""


def _index(key: Any) -> int:
    """The sample index of a plain index or of a (seed, epoch, index) key."""
    return int(key[2]) if isinstance(key, tuple) else int(key)


def is_pixel_transform(t: dict[str, Any]) -> bool:
    """A read transform that is a per-channel normalization of 8-bit image pixels."""
    return {"scale", "mean", "std"} <= set(t)


def _store(location: str, cache_dir: str | Path | None, cache_limit_bytes: int) -> Store:
    cache = DiskCache(cache_dir, cache_limit_bytes) if cache_dir and is_remote(location) else None
    return Store(location, cache)


def _cell(arr: Any, j: int) -> memoryview:
    """Bytes of row j of a binary column, without copying the column."""
    import pyarrow as pa

    if not pa.types.is_fixed_size_binary(arr.type):  # variable size (encoded images)
        return memoryview(arr[j].as_buffer())
    width = arr.type.byte_width
    data = arr.buffers()[1]
    start = (arr.offset + j) * width
    return memoryview(data)[start : start + width]


# Writing lives in its own module; its names stay reachable here, where callers found them.
def decode_rgb(data: bytes | memoryview, height: int, width: int) -> np.ndarray:
    """(3, height, width) uint8 pixels of image file bytes: Pillow's RGB conversion and a
    bilinear resize, the calls convert.py resizes with at write time (shard reading and the
    interop readers use it). Bytes that are not a readable image raise ValueError naming
    Pillow's error class."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(type(exc).__name__) from None
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


from hpcml.data.shards.hash_cache import sha256_of as sha256_file  # noqa: E402, F401
from hpcml.data.shards.write import ShardWriter as ShardWriter  # noqa: E402
from hpcml.data.shards.write import parse_size as parse_size  # noqa: E402
from hpcml.data.shards.write import spec as spec  # noqa: E402
from hpcml.data.shards.write import write_shard_set as write_shard_set  # noqa: E402
