"""Where a shard set lives: a local folder, or a prefix in an S3-compatible bucket.

S3 goes through pyarrow's own filesystem layer (`pyarrow.fs`, the AWS C++ SDK that pyarrow
ships), already installed for the shard files themselves: no boto3, no second client.

    s3://BUCKET/PREFIX[?endpoint_override=HOST:PORT&scheme=https&region=REGION
                        &tls_ca_file_path=/path/to/ca.pem]

- Credentials come from the environment as the AWS SDK reads them (AWS_ACCESS_KEY_ID,
  AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, instance roles), never from the URL:
  a URL with credentials in it is refused, since URLs end up in logs, summaries and MLflow.
- TLS (https, the SDK's certificate checks) unless the URL says `scheme=http`, which is meant
  for an object store on the same host or a private network.
- A server whose certificate is signed by a private CA (an on-premises MinIO or Ceph): the CA's
  PEM file as `tls_ca_file_path=` in the URL (pyarrow's own `S3FileSystem` option, passed
  through), or else in the environment variable `AWS_CA_BUNDLE` (the name the AWS SDKs and CLI
  read). It replaces the system's CA list for that shard set. A certificate the client does not
  trust stops the read with one sentence naming the certificate and these two ways.
- `endpoint_override` points at any S3-compatible service (MinIO, Ceph RGW, a cloud's S3 API).

A remote shard is read whole into memory when first needed (at most `data.shard_cache` shards
per reading process, as with the memory maps of a local folder) and its sha256 is checked
against the manifest right there, so a corrupted or replaced object is refused before a sample
of it is used, without a pass over the whole set before training. With `data.cache_dir` the
checked bytes are kept on local disk and memory-mapped from there (`hpcml.data.shards.cache`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from hpcml import crypt
from hpcml.data.shards.cache import DiskCache
from hpcml.data.shards.hash_cache import sha256_of
from hpcml.errors import DataError

SCHEMES = ("s3://",)


def _key(name: str) -> crypt.Key:
    key = crypt.key_from_env(required_for=f"shard {name}")
    assert key is not None
    return key


def open_ipc(path: str | Path) -> Any:
    """An Arrow IPC file reader over a local shard file: memory-mapped, or, sealed
    (`hpcml data shard --encrypt`), decrypted whole into memory with the environment's key."""
    import pyarrow as pa

    path = Path(path)
    if crypt.file_is_sealed(path):
        return pa.ipc.open_file(
            pa.BufferReader(crypt.unseal(path.read_bytes(), _key(str(path)), str(path)))
        )
    return pa.ipc.open_file(pa.memory_map(str(path), "r"))


def is_remote(location: str | Path) -> bool:
    return str(location).startswith(SCHEMES)


class Store:
    """Read access to the files of one shard set, local or remote."""

    def __init__(self, location: str | Path, cache: DiskCache | None = None) -> None:
        self.location = str(location)
        self.remote = is_remote(location)
        self.cache = cache if self.remote else None  # a local folder needs no copy
        if self.remote:
            self.fs, self.prefix = _s3(self.location)
            self.root = Path()
        else:
            self.root = Path(location).expanduser()
            self.fs, self.prefix = None, ""

    def describe(self, name: str = "") -> str:
        if not name:
            return self.location if self.remote else str(self.root)
        if self.remote:
            return f"{self.location.split('?')[0].rstrip('/')}/{name}"
        return str(self.root / name)

    def is_set(self) -> bool:
        """The location exists (a folder, or a bucket prefix holding anything)."""
        if not self.remote:
            return self.root.is_dir()
        return True  # a prefix is not an object; the manifest read says what is missing

    def size(self, name: str) -> int | None:
        """Bytes of `name`, None when it does not exist."""
        if not self.remote:
            p = self.root / name
            return p.stat().st_size if p.is_file() else None
        import pyarrow.fs as pafs

        info = self._call(lambda: self.fs.get_file_info(self._key(name)), name)
        return int(info.size) if info.type == pafs.FileType.File else None

    def read_bytes(self, name: str) -> bytes:
        if not self.remote:
            return (self.root / name).read_bytes()
        return bytes(self._read_buffer(name))

    def open_shard(self, name: str, sha256: str | None, size: int | None = None) -> Any:
        """An Arrow IPC file reader over shard `name`: memory-mapped when local; when remote,
        read whole and checked against `sha256`, then memory-mapped from the disk cache when
        there is one (a cached copy of the right size and sha256 is used without a download)."""
        import pyarrow as pa

        if not self.remote:
            return open_ipc(self.root / name)
        cache = self.cache if sha256 is not None and size is not None else None
        if cache is not None:
            assert sha256 is not None and size is not None
            hit = cache.lookup(name, sha256, size)
            if hit is not None:
                try:
                    return open_ipc(hit)
                except (OSError, pa.ArrowInvalid):  # evicted or damaged since the lookup
                    cache.discard(hit)
        buf = self._read_buffer(name)
        if sha256 is not None and hashlib.sha256(memoryview(buf)).hexdigest() != sha256:
            raise DataError(
                f"shard {self.describe(name)} does not match the sha256 in its manifest "
                "(corrupted or replaced after writing); upload the shard set again."
            )
        if cache is not None:
            assert sha256 is not None
            kept = cache.put(name, sha256, buf)
            if kept is not None:
                try:
                    return open_ipc(kept)
                except (OSError, pa.ArrowInvalid):  # evicted by another process already
                    pass
        if crypt.is_sealed(bytes(memoryview(buf)[: len(crypt.MAGIC)])):
            buf = pa.py_buffer(crypt.unseal(bytes(memoryview(buf)), _key(name), name))
        return pa.ipc.open_file(pa.BufferReader(buf))

    def sha256(self, name: str) -> str:
        if not self.remote:
            return sha256_of(self.root / name)
        return hashlib.sha256(memoryview(self._read_buffer(name))).hexdigest()

    def _key(self, name: str) -> str:
        return f"{self.prefix.rstrip('/')}/{name}" if self.prefix else name

    def _read_buffer(self, name: str) -> Any:
        def read() -> Any:
            with self.fs.open_input_file(self._key(name)) as f:
                return f.read_buffer()

        return self._call(read, name)

    def _call(self, fn: Any, name: str) -> Any:
        try:
            return fn()
        except FileNotFoundError:
            raise DataError(
                f"{self.describe(name)} does not exist; check data.path, or upload the shard "
                "set there (every file of the folder `hpcml data shard` wrote)."
            ) from None
        except OSError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if _is_certificate_error(str(exc)):
                raise DataError(
                    f"{self.describe(name)} cannot be read: the server's TLS certificate is not "
                    f"trusted ({first[:160]}); give the CA that signed it as tls_ca_file_path= "
                    "in data.path or in the environment variable AWS_CA_BUNDLE."
                ) from None
            raise DataError(
                f"{self.describe(name)} cannot be read ({first[:200]}); check the endpoint, the "
                "credentials in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and "
                "the bucket's permissions."
            ) from None


# curl's words for an untrusted or unusable certificate (curlCode 60: peer certificate not OK,
# 77: the CA file cannot be used), as the AWS SDK passes them on.
CERTIFICATE_WORDS = ("certificate", "ca cert", "curlcode: 60", "curlcode: 77", "x509")


def _is_certificate_error(message: str) -> bool:
    low = message.lower()
    return any(w in low for w in CERTIFICATE_WORDS)


def _with_ca(location: str) -> str:
    """`location` with `tls_ca_file_path` from AWS_CA_BUNDLE when the URL names none; the file
    checked to be readable either way, so a typo is one sentence, not a TLS failure later."""
    query = dict(parse_qsl(urlsplit(location).query))
    ca = query.get("tls_ca_file_path")
    where = "tls_ca_file_path in data.path"
    if ca is None and os.environ.get("AWS_CA_BUNDLE"):
        ca, where = os.environ["AWS_CA_BUNDLE"], "AWS_CA_BUNDLE"
        location += ("&" if "?" in location else "?") + f"tls_ca_file_path={quote(ca, safe='/')}"
    if ca is not None and not (os.path.isfile(ca) and os.access(ca, os.R_OK)):
        raise DataError(
            f"{where} names {ca!r}, which is not a readable file; give the path of the PEM "
            "file of the CA that signed the object store's certificate."
        )
    return location


def _s3(location: str) -> tuple[Any, str]:
    parts = urlsplit(location)
    if parts.username or parts.password:
        raise DataError(
            f"data.path {location.split('@')[-1]!r} carries credentials in the URL; remove them "
            "and set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment instead."
        )
    if not parts.netloc:
        raise DataError(f"data.path {location!r} names no bucket; write s3://BUCKET/PREFIX.")
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(_with_ca(location))
    except (ValueError, OSError, TypeError) as exc:
        raise DataError(
            f"data.path {location!r} is not a usable S3 URL ({str(exc)[:200]}); write "
            "s3://BUCKET/PREFIX[?endpoint_override=HOST:PORT&scheme=https]."
        ) from None
    return fs, path
