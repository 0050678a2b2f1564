"""Token data for language models: uint16 memmaps (nanoGPT's `train.bin` / `val.bin` format)
read as windows of `seq_len + 1` tokens, and `prepare_pystdlib`, which turns the Python
standard library's own source files into byte-level tokens (a real corpus on every machine).

Training windows start at random offsets drawn by `RandomWindowSampler`: the offsets of an
epoch are one stream fixed by (seed, epoch) and rank r takes every W-th of them, so a sample
is fixed by seed, rank and step (exact resume) and 1 process with batch 2B sees the same
windows as 2 processes with batch B each. Validation uses fixed, evenly spaced windows.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from hpcml.config import DataConfig
from hpcml.errors import DataError

FORMAT = "hpcml-tokens/1"
TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
META_FILE = "meta.json"
EOT = 0
"""Byte-level corpora separate documents with a NUL byte, which never occurs in source text."""


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window i is tokens[start_i : start_i + seq_len + 1] split into input and next-token
    target. Without `starts`, index i *is* the start offset (every offset is a sample)."""

    def __init__(self, path: Path, seq_len: int, starts: np.ndarray | None = None) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.n_tokens = os.path.getsize(self.path) // 2
        self.starts = starts
        self._tokens: np.ndarray | None = None  # opened lazily: memmaps do not cross fork well
        if self.n_tokens < seq_len + 2:
            raise DataError(
                f"token file {self.path} holds {self.n_tokens} tokens, fewer than data.seq_len "
                f"{seq_len} + 2; lower data.seq_len or prepare more data."
            )

    @property
    def n_starts(self) -> int:
        return self.n_tokens - self.seq_len - 1

    def __len__(self) -> int:
        return len(self.starts) if self.starts is not None else self.n_starts

    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        return self._tokens

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i]) if self.starts is not None else int(i)
        chunk = torch.from_numpy(self.tokens()[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def make_sampler(self, rank: int, world_size: int, seed: int) -> RandomWindowSampler:
        """Used by `EpochLoader` in place of a DistributedSampler."""
        return RandomWindowSampler(
            self.n_starts, self.n_tokens // self.seq_len, rank, world_size, seed
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


class RandomWindowSampler(Sampler[int]):
    """Uniform random window starts; an epoch is as many windows as cover the tokens once."""

    def __init__(
        self, n_starts: int, windows_per_epoch: int, rank: int, world_size: int, seed: int
    ) -> None:
        self.n_starts = n_starts
        self.total = windows_per_epoch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.total // self.world_size

    def _global_order(self, epoch: int) -> torch.Tensor:
        # One generator per (seed, epoch), the same on every rank and for every world size; the
        # whole epoch is drawn, so the order does not depend on the world size either.
        g = torch.Generator().manual_seed(hash_seed(self.seed, epoch))
        return torch.randint(0, self.n_starts, (self.total,), generator=g)

    def __iter__(self) -> Iterator[int]:
        starts = self._global_order(self.epoch)[: len(self) * self.world_size]
        yield from starts[self.rank :: self.world_size].tolist()

    def remainder(self, epoch: int, start: int) -> list[int]:
        """This rank's share of epoch `epoch` after its first `start` windows of the global
        order, whatever world size took those (an elastic resume)."""
        rest = self._global_order(epoch)[start:]
        rest = rest[: len(rest) // self.world_size * self.world_size]
        return rest[self.rank :: self.world_size].tolist()


def hash_seed(*parts: int) -> int:
    return zlib.crc32(np.asarray(parts, dtype=np.int64).tobytes()) & 0x7FFFFFFF


def eval_starts(n_tokens: int, seq_len: int, limit: int | None) -> np.ndarray:
    """Non-overlapping windows, or `limit` of them evenly spaced through the file."""
    count = (n_tokens - 1) // seq_len
    starts = np.arange(count, dtype=np.int64) * seq_len
    if limit is not None and count > limit:
        starts = starts[np.linspace(0, count - 1, limit).round().astype(np.int64)]
    return starts


def _read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META_FILE
    if not path.exists():
        return {}
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise DataError(f"{path} is not valid JSON; prepare the token data again.") from None
    return meta


def _files(cfg: DataConfig) -> tuple[Path, Path | None, dict[str, Any]]:
    if cfg.path is None:
        raise DataError(
            "data source 'tokens' needs data.path: a folder with train.bin and val.bin (make one "
            "with `hpcml data prepare pystdlib --out DIR`) or one uint16 .bin file."
        )
    root = Path(cfg.path).expanduser()
    if root.is_dir():
        train, val = root / TRAIN_FILE, root / VAL_FILE
        if not train.exists():
            raise DataError(
                f"data.path {root} has no {TRAIN_FILE}; make one with "
                f"`hpcml data prepare pystdlib --out {root}`."
            )
        return train, (val if val.exists() else None), _read_meta(root)
    if root.is_file():
        return root, None, _read_meta(root.parent)
    raise DataError(
        f"data.path {root} does not exist; make token data with "
        f"`hpcml data prepare pystdlib --out {root}`."
    )


def check_tokens(cfg: DataConfig) -> None:
    _files(cfg)


def load_tokens(cfg: DataConfig) -> Any:
    from hpcml.data.splits import Splits

    train_path, val_path, meta = _files(cfg)
    if os.path.getsize(train_path) % 2:
        raise DataError(f"{train_path} has an odd number of bytes, so it is not a uint16 file.")
    seq = cfg.seq_len
    if val_path is None:
        # One file: the last val_fraction of it is held out (a contiguous tail, never shuffled in).
        full = TokenWindows(train_path, seq)
        n_val = max(int(full.n_tokens * cfg.val_fraction), seq + 2)
        cut = full.n_tokens - n_val
        train = TokenWindows(train_path, seq)
        train.n_tokens = cut
        val = TokenWindows(train_path, seq, eval_starts(n_val, seq, cfg.eval_windows) + cut)
    else:
        train = TokenWindows(train_path, seq)
        val = TokenWindows(val_path, seq, None)
        val.starts = eval_starts(val.n_tokens, seq, cfg.eval_windows)
    vocab = cfg.vocab_size or meta.get("vocab_size") or int(train.tokens().max()) + 1
    fingerprint = meta.get("fingerprint") or _sha256_files(train_path, val_path)
    return Splits(
        train, val, (seq,), int(vocab), fingerprint, input_dtype="int64", target_shape=(seq,)
    )


def _sha256_files(*paths: Path | None) -> str:
    h = hashlib.sha256()
    for p in paths:
        if p is None:
            continue
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def pystdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted, without installed third-party packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )


def prepare_pystdlib(
    out: Path, val_fraction: float = 0.05, max_bytes: int | None = None
) -> dict[str, Any]:
    """Write byte-level tokens of the stdlib sources: train.bin, val.bin (uint16), meta.json.

    Files go to validation by a hash of their path (stable across machines and runs), so the
    split does not depend on file order or on how much was read.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive).")
    try:  # before reading the corpus: an unusable --out fails in a moment, not after it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"--out {out} cannot be created ({exc.strerror or exc}); pass a folder you can write."
        ) from None
    root = Path(sysconfig.get_paths()["stdlib"])
    files = pystdlib_files(root)
    if not files:
        raise DataError(f"no .py files under the standard library at {root}.")
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    read = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions) are skipped, the corpus stays valid
        split = "val" if zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000 else "train"
        parts[split].append(data + bytes([EOT]))
        counts[split] += 1
        read += len(data) + 1
        if max_bytes is not None and read >= max_bytes:
            break
    if not parts["val"] or not parts["train"]:
        raise DataError("the corpus is too small to split; raise --max-bytes or --val-fraction.")
    sha: dict[str, str] = {}
    tokens: dict[str, int] = {}
    for split, name in (("train", TRAIN_FILE), ("val", VAL_FILE)):
        arr = np.frombuffer(b"".join(parts[split]), dtype=np.uint8).astype(np.uint16)
        raw = arr.tobytes()
        _write_atomic(out / name, raw)
        sha[name] = hashlib.sha256(raw).hexdigest()
        tokens[split] = int(arr.size)
    meta = {
        "format": FORMAT,
        "dtype": "uint16",
        "tokenizer": "bytes",
        "vocab_size": 256,
        "eot_token": EOT,
        "source": "pystdlib",
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "val_fraction": val_fraction,
        "files": counts,
        "tokens": tokens,
        "sha256": sha,
        "fingerprint": hashlib.sha256(json.dumps(sha, sort_keys=True).encode()).hexdigest(),
    }
    _write_atomic(out / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    return meta
