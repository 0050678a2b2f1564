"""The manifest of a shard set (`manifest.json`): its schema, checked whenever one is read, and
the check of a shard file against its entry.

A manifest may come from anywhere (a copied folder, a bucket someone else writes), so every key
the reader relies on is checked at load with a pydantic schema, and a manifest that does not fit
stops with one sentence naming the key, never a KeyError later. Keys the reader does not use
(`source`, `classes`, `features`, `hpcml`, the rest of `transform`) are kept as they are, and
count in the version id like every other byte of the manifest.

What the schema cannot see, the shard files themselves, is checked from each file's Arrow
metadata when it is opened (and, for a local folder, for every shard at load): the columns and
their widths against the sample spec, and the number of rows against the manifest's count.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpcml.errors import DataError

FORMAT = "hpcml-shards/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
COMPRESSIONS = ("none", "lz4", "zstd")
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
"""A shard file is a plain name in the set's folder: no path, nothing hidden."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TensorSpec(_Strict):
    dtype: str
    shape: list[int]

    @field_validator("dtype")
    @classmethod
    def _numeric(cls, v: str) -> str:
        try:
            kind = np.dtype(v).kind
        except TypeError:
            raise ValueError(f"{v!r} is not a numpy dtype") from None
        if kind not in "biuf":
            raise ValueError(f"{v!r} is not a numeric dtype")
        return v

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v):
            raise ValueError(f"{v} has a dimension under 1")
        return v

    def width(self) -> int:
        """Bytes of one sample of this spec."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class SampleSpec(_Strict):
    layout: Literal["tensor", "tokens", "encoded"]
    """tensor: x holds the sample's bytes; tokens: a window of token ids; encoded: an image
    file's bytes (variable size), decoded when read to the (3, H, W) uint8 spec x gives."""
    x: TensorSpec
    y: TensorSpec


class ShardEntry(_Strict):
    file: str = Field(pattern=_FILE.pattern)
    samples: int = Field(ge=1)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # pydantic searches: anchored here


class SplitEntry(_Strict):
    samples: int = Field(ge=0)
    rows_per_batch: int = Field(ge=1)
    shards: list[ShardEntry]

    @model_validator(mode="after")
    def _counts_add_up(self) -> SplitEntry:
        total = sum(s.samples for s in self.shards)
        if total != self.samples:
            raise ValueError(f"samples is {self.samples} but its shards hold {total}")
        return self


class ReadTransform(_Strict):
    scale: float | None = None
    mean: list[float] | None = None
    std: list[float] | None = None

    @model_validator(mode="after")
    def _pairs(self) -> ReadTransform:
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std must be given together")
        std = self.std or []
        if self.mean is not None and (len(self.mean) != len(std) or any(s <= 0 for s in std)):
            raise ValueError("std must be positive, one per mean")
        return self


class Transform(_Strict):
    read: ReadTransform = ReadTransform()


class Manifest(_Strict):
    format: Literal["hpcml-shards/1"]
    compression: Literal["none", "lz4", "zstd"]
    sample: SampleSpec
    num_classes: int = Field(ge=1)
    seq_len: int | None = Field(None, ge=1)
    transform: Transform = Transform()
    splits: dict[Literal["train", "val"], SplitEntry]

    @model_validator(mode="after")
    def _tokens(self) -> Manifest:
        x = self.sample.x
        if self.sample.layout == "encoded" and (len(x.shape) != 3 or x.shape[0] != 3):
            raise ValueError("an encoded image set decodes to shape [3, H, W]")
        if self.sample.layout == "tokens":
            if self.seq_len is None:
                raise ValueError("a tokens set needs seq_len")
            if self.sample.x.shape != [self.seq_len + 1]:
                raise ValueError(f"tokens windows must have shape [{self.seq_len + 1}]")
        return self


def canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def version_id(manifest: dict[str, Any]) -> str:
    """The shard set's version: sha256 over its canonical manifest."""
    return hashlib.sha256(canonical(manifest)).hexdigest()


def validate(manifest: Any, where: str) -> dict[str, Any]:
    """`manifest` (parsed JSON) when it fits the schema; one sentence naming the first key that
    does not, otherwise."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(
            f"{where} has format {found!r}, not {FORMAT!r}; write the shard set again with this hpcml."
        )
    try:
        Manifest.model_validate(manifest)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        problem = str(err["msg"]).removeprefix("Value error, ")
        raise DataError(
            f"{where} is not a valid shard set manifest: {key}: {problem[:160]}; write the shard "
            "set again with `hpcml data shard`."
        ) from None
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of the shard set at `folder`: a local folder or an s3:// URL
    (`hpcml.data.shards.store`), checked against the schema."""
    from hpcml.data.shards.store import Store

    store = Store(folder)
    path = store.describe(MANIFEST)
    if not store.is_set():
        raise DataError(
            f"shard folder {store.describe()} does not exist; write one with "
            f"`hpcml data shard SOURCE --out {store.describe()}`."
        )
    if store.size(MANIFEST) is None:
        raise DataError(
            f"{store.describe()} holds no {MANIFEST}, so it is not a shard set; write one with "
            f"`hpcml data shard SOURCE --out DIR`."
        )
    try:
        manifest = json.loads(store.read_bytes(MANIFEST).decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{path} is not valid JSON; write the shard set again.") from None
    return validate(manifest, path)


def check_shard(reader: Any, manifest: dict[str, Any], split: str, k: int, where: str) -> None:
    """Shard `k` of `split`, opened as an Arrow IPC file `reader`, has the columns the sample
    spec gives and the rows the manifest counts, from its metadata (and, for the count, its
    last record batch: a compressed one of about 64 KiB is decompressed for it)."""
    import pyarrow as pa

    sample, entry = manifest["sample"], manifest["splits"][split]
    encoded = sample["layout"] == "encoded"
    expected = {
        "id": pa.int64(),
        "x": pa.binary() if encoded else pa.binary(TensorSpec.model_validate(sample["x"]).width()),
        "y": pa.binary(TensorSpec.model_validate(sample["y"]).width()),
    }
    schema = reader.schema
    got = {f.name: f.type for f in schema}
    if schema.names != list(expected) or any(got[n] != t for n, t in expected.items()):
        raise DataError(
            f"shard {where} has columns {', '.join(f'{f.name} {f.type}' for f in schema)}, not "
            "the id, x and y the manifest's sample spec gives; write the shard set again."
        )
    n, per = int(entry["shards"][k]["samples"]), int(entry["rows_per_batch"])
    batches = reader.num_record_batches
    rows = 0 if batches == 0 else (batches - 1) * per + reader.get_batch(batches - 1).num_rows
    if batches != math.ceil(n / per) or rows != n:
        raise DataError(
            f"shard {where} holds {rows} samples in {batches} record batches, but the manifest "
            f"says {n} in batches of {per}; the manifest was changed after writing: write the "
            "shard set again."
        )
