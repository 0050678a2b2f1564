"""Tensors of the Open Inference Protocol v2: datatypes, shapes, raw bytes and conversions.

Shared by the REST codec (JSON `data` and the binary tensor extension) and the gRPC endpoint
(`contents` and `raw_input_contents`). Every problem a client can cause raises `ProtocolError`
(HTTP 400 / gRPC INVALID_ARGUMENT) with one sentence saying what and where.

Raw tensors are little-endian, row-major and unpadded; BYTES elements are each a 4-byte
little-endian length followed by that many bytes (the protocol's binary layout). numpy reads
and writes these directly, so no library beyond it is needed.

A tensor sent with another datatype than the model's is converted only when no value changes
(integers in range, booleans, integers a float holds exactly) or, between floats, when values
are only rounded (FP64 -> FP32 without overflow); anything else is a 400 naming both datatypes.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

# The protocol's tensor datatypes and the numpy dtype each one maps to.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_NUMPY_TO_DATATYPE = {v: k for k, v in DATATYPES.items() if k != "BYTES"}
# Most dimensions a tensor may have, and most elements: larger requests are refused before
# anything is allocated (the body limit bounds real data; these bound what a shape claims).
MAX_DIMS = 16
MAX_ELEMENTS = 2**31 - 1
_LENGTH = struct.Struct("<I")
# What one decoded BYTES element costs beyond its data: the array's pointer and an empty
# `bytes` object. A raw element costs at least its 4-byte length, so a BYTES tensor decodes to
# at most about 10x its raw size.
BYTES_ELEMENT_OVERHEAD = 8 + sys.getsizeof(b"")


class ProtocolError(Exception):
    """A request the protocol or the model's signature does not allow (HTTP 400)."""

    status = 400

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def datatype_of_array(a: np.ndarray) -> str:
    return _NUMPY_TO_DATATYPE.get(a.dtype, "BYTES")


def dtype_of(datatype: Any, where: str) -> np.dtype:
    dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise ProtocolError(
            f"{where} has datatype {datatype!r}, which the protocol does not define; "
            f"use one of {', '.join(DATATYPES)}."
        )
    return dtype


def check_shape(raw: Any, where: str) -> tuple[int, ...]:
    """A tensor shape: a list of non-negative integers (not booleans) of bounded size."""
    if (
        not isinstance(raw, list | tuple)
        or len(raw) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw)
    ):
        raise ProtocolError(
            f"{where} 'shape' must be a list of at most {MAX_DIMS} non-negative integers, "
            f"got {_short(raw)}."
        )
    count = 1
    for d in raw:
        count *= max(d, 1)
        if count > MAX_ELEMENTS:
            raise ProtocolError(
                f"{where} 'shape' {_short(raw)} describes more than {MAX_ELEMENTS} elements."
            )
    return tuple(int(d) for d in raw)


def decoded_bytes(shape: tuple[int, ...], datatype: str) -> int:
    """Memory the tensor a shape claims takes once decoded (BYTES: without the elements' data,
    which the request must carry)."""
    dtype = DATATYPES[datatype]
    per_element = BYTES_ELEMENT_OVERHEAD if dtype.kind == "O" else dtype.itemsize
    return element_count(shape) * per_element


class DecodeBudget:
    """The decoded size one request may reach, charged from the shapes it claims before any
    tensor is allocated: a ~100-byte request cannot make the server allocate gigabytes."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0

    def charge(self, shape: tuple[int, ...], datatype: str, where: str) -> None:
        if self.limit_bytes is None:
            return
        size = decoded_bytes(shape, datatype)
        self.used_bytes += size
        if self.used_bytes > self.limit_bytes:
            raise ProtocolError(
                f"{where} shape {list(shape)} of {datatype} decodes to {size} bytes, which takes "
                f"the request past the server's limit of {self.limit_bytes} decoded bytes "
                "(max_decoded_bytes); send fewer samples per request.",
                status=413,
            )


def element_count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_json_data(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The tensor of a JSON `data` array (flat or nested, row-major) with the given shape."""
    dtype = DATATYPES[datatype]
    if not isinstance(data, list):
        raise ProtocolError(f"{where} 'data' must be a JSON array (flat or nested, row-major).")
    try:
        if dtype.kind == "f":
            with np.errstate(over="ignore"):
                array = _float_array(data, dtype)
            # JSON has no NaN or Infinity: a null became NaN, or a number overflowed.
            if not np.isfinite(array).all():
                raise ProtocolError(
                    f"{where} 'data' holds null or values too large for {datatype}; send numbers."
                )
        else:
            array = np.asarray(data, dtype=object if dtype.kind == "O" else None)
            array = _checked_json_values(array, dtype, datatype, where)
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise ProtocolError(
            f"{where} 'data' cannot be read as {datatype}; send a flat or rectangular nested "
            "array of "
            + (
                "strings."
                if datatype == "BYTES"
                else "booleans."
                if datatype == "BOOL"
                else "numbers."
            )
        ) from None
    expected = element_count(shape)
    if array.size != expected:
        raise ProtocolError(
            f"{where} has {array.size} values in 'data' but shape {list(shape)} needs {expected}."
        )
    return array.reshape(shape)


def _float_array(data: list[Any], dtype: np.dtype) -> np.ndarray:
    """A float array of a JSON array. A flat list goes through `np.fromiter`, which skips
    `np.asarray`'s shape discovery (~15% of the conversion) and reads every element as
    `np.asarray` does (null -> NaN, booleans, numeric strings; the same errors otherwise); a
    nested list through `np.asarray`. Either allocates for the values present only."""
    if data and not isinstance(data[0], list):
        return np.fromiter(data, dtype, len(data))
    return np.asarray(data, dtype=dtype)


def _checked_json_values(
    array: np.ndarray, dtype: np.dtype, datatype: str, where: str
) -> np.ndarray:
    if dtype.kind == "O":
        flat = array.reshape(-1)
        if not all(isinstance(v, str) for v in flat):
            raise ValueError("BYTES data must be strings")
        out = np.empty(flat.shape, dtype=object)
        out[:] = [v.encode() for v in flat]
        return out.reshape(array.shape)
    if array.size == 0:
        return array.astype(dtype)
    if dtype.kind == "b":
        if array.dtype.kind != "b":
            raise ValueError("BOOL data must be true or false")
        return array
    # Integers: JSON numbers that are integers and fit the datatype; no silent truncation.
    if array.dtype.kind not in "iub":
        raise ValueError("integer data must be whole numbers")
    return _range_checked(array, dtype, datatype, where)


def _range_checked(array: np.ndarray, dtype: np.dtype, datatype: str, where: str) -> np.ndarray:
    info = np.iinfo(dtype)
    if array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
        raise ProtocolError(f"{where} holds values outside the range of {datatype}.")
    return array.astype(dtype)


def from_raw(
    raw: bytes | memoryview, datatype: str, shape: tuple[int, ...], where: str
) -> np.ndarray:
    """The tensor in raw bytes (binary extension, gRPC raw contents), checked against its shape."""
    dtype = DATATYPES[datatype]
    expected = element_count(shape)
    if dtype.kind == "O":
        return deserialize_bytes(raw, expected, where).reshape(shape)
    if len(raw) != expected * dtype.itemsize:
        raise ProtocolError(
            f"{where} has {len(raw)} bytes of binary data but shape {list(shape)} of {datatype} "
            f"needs {expected * dtype.itemsize}."
        )
    # Copied: frombuffer views the request body read-only, and backends may write in place.
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    return check_finite(array, datatype, where)


def check_finite(array: np.ndarray, datatype: str, where: str) -> np.ndarray:
    """`array`, or a ProtocolError when a float tensor holds NaN or infinity: JSON cannot carry
    them, so binary and gRPC tensors are held to the same rule."""
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ProtocolError(
            f"{where} holds NaN or infinite {datatype} values; send finite numbers (JSON cannot "
            "carry them either)."
        )
    return array


def deserialize_bytes(raw: bytes | memoryview, count: int, where: str) -> np.ndarray:
    """BYTES elements, each a 4-byte little-endian length and its bytes, exactly `count` of them."""
    view = memoryview(raw)
    # Each element carries at least its 4-byte length: a count the data cannot hold is refused
    # before the array of `count` pointers is allocated.
    if count * _LENGTH.size > len(view):
        raise ProtocolError(
            f"{where} has {len(view)} bytes of binary BYTES data, too few for the {count} "
            f"elements its shape needs (each takes at least {_LENGTH.size} bytes)."
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise ProtocolError(
                f"{where} has binary BYTES data for {i} elements but its shape needs {count}."
            )
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise ProtocolError(
                f"{where} element {i} claims {length} bytes but only {len(view) - offset} remain."
            )
        out[i] = bytes(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise ProtocolError(
            f"{where} has {len(view) - offset} bytes of BYTES data beyond its {count} elements."
        )
    return out


def to_raw(array: np.ndarray) -> bytes:
    """Raw little-endian bytes of a tensor (BYTES: length-prefixed elements)."""
    if array.dtype.kind == "O":
        parts = []
        for v in array.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode()
            parts.append(_LENGTH.pack(len(b)))
            parts.append(b)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def to_json_data(array: np.ndarray) -> Any:
    """A flat row-major `data` value; orjson writes float32/64 and int32/64 arrays natively."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype in (np.float32, np.float64, np.int32, np.int64):
        return flat
    if flat.dtype.kind == "O":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


def convert(array: np.ndarray, datatype: str, target: str, where: str) -> np.ndarray:
    """`array` (sent as `datatype`) as the model's `target` datatype, or a ProtocolError."""
    if datatype == target:
        return array
    dst = DATATYPES[target]
    src = array.dtype
    refusal = ProtocolError(
        f"{where} has datatype {target}, but the request sent {datatype} whose values cannot "
        f"all be represented as {target}; send {target}."
    )
    if dst.kind == "O" or src.kind == "O":
        raise refusal
    if src.kind == "b":
        return array.astype(dst)
    if dst.kind == "b":
        raise refusal
    if dst.kind in "iu":
        if src.kind == "f":
            raise refusal
        try:
            return _range_checked(array, dst, target, where)
        except ProtocolError:
            raise refusal from None
    with np.errstate(over="ignore", invalid="ignore"):
        converted = array.astype(dst)
        if src.kind == "f":
            # Rounding to a narrower float is the conversion; overflowing to infinity is not.
            ok = bool(np.array_equal(np.isinf(converted), np.isinf(array)))
        else:
            ok = bool(np.isfinite(converted).all()) and bool(
                np.array_equal(converted.astype(src), array)
            )
    if not ok:
        raise refusal
    return converted
