"""The wire rules every step message shares: a msgpack map with a version tag, numbers in
columns as little-endian numpy bytes in a msgpack `bin`, and strict checks on the way in.

A decoder reads the whole map and checks every field before it builds anything, so a bad
payload raises ProtocolError naming the field and nothing is half-built. No pickle anywhere.
"""

from __future__ import annotations

import math
import re
import sys
from array import array
from typing import Any

import msgpack
import numpy as np

MAX_PAYLOAD_BYTES = 64 << 20
MAX_BATCH = 1 << 16
MAX_DRAFTED = 1024
MAX_RID_CHARS = 256
INT32_MAX = (1 << 31) - 1
I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
F32 = np.dtype("<f4")
F64 = np.dtype("<f8")
U8 = np.dtype("u1")
# Short int/float lists go through the stdlib `array` (a list of 32 ints: ~1 us, numpy ~5 us);
# its items are native-endian, which is the wire's little-endian only on little-endian hosts.
_ARRAY_CODES = {I32: "i", I64: "q", F64: "d"} if sys.byteorder == "little" else {}
TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class ProtocolError(ValueError):
    """A malformed step message."""


def pack(msg: dict[str, Any]) -> bytes:
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # a field of a type msgpack cannot carry
        raise ProtocolError(f"cannot encode {msg.get('m', 'message')!r}: {e}") from None


def unpack(payload: Any, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict[str, Any]:
    """The map a payload holds; ProtocolError when it is not bytes, too big or not msgpack."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {max_bytes}")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many unrelated types for bad bytes
        raise ProtocolError(f"not a valid msgpack message: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message must be a map")
    return msg


def check_header(msg: dict[str, Any], kind: str, version: int, keys: frozenset[str]) -> None:
    """The message is a `kind` message of `version` with exactly `keys` (unknown or missing
    fields are errors: a newer writer must bump the version)."""
    if msg.get("m") != kind:
        raise ProtocolError(f"expected a {kind!r} message, got {msg.get('m')!r}")
    v = msg.get("v")
    if type(v) is not int or v != version:  # True == 1 and 1.0 == 1: not versions
        raise ProtocolError(f"{kind}: unsupported version {v!r} (this reader knows {version})")
    check_keys(msg, keys, kind)


def check_keys(msg: Any, keys: frozenset[str], what: str) -> None:
    if not isinstance(msg, dict):
        raise ProtocolError(f"{what} must be a map")
    if set(msg) != keys:
        missing, unknown = sorted(keys - set(msg)), sorted(map(str, set(msg) - keys))
        raise ProtocolError(f"{what}: missing fields {missing}, unknown fields {unknown}")


# --- fields -------------------------------------------------------------------------------------
def want_int(value: Any, name: str, lo: int = 0, hi: int = INT32_MAX) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def want_float(value: Any, name: str, lo: float = -math.inf) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < lo:
        raise ProtocolError(f"{name} must be a finite number >= {lo}, got {value!r}")
    return float(value)


def want_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{name} must be a boolean, got {value!r}")
    return value


def want_str(value: Any, name: str, max_chars: int) -> str:
    if type(value) is not str or len(value) > max_chars:
        raise ProtocolError(f"{name} must be a string of at most {max_chars} chars")
    return value


def want_rids(value: Any, name: str) -> list[str]:
    """A list of request ids (non-empty strings of at most MAX_RID_CHARS)."""
    if type(value) is not list or len(value) > MAX_BATCH:
        raise ProtocolError(f"{name} must be a list of at most {MAX_BATCH} request ids")
    for rid in value:
        if type(rid) is not str or not 0 < len(rid) <= MAX_RID_CHARS:
            raise ProtocolError(f"{name}: bad request id {rid!r}")
    return value


def want_traceparent(value: Any, name: str = "traceparent") -> str | None:
    if value is not None and (type(value) is not str or not TRACEPARENT.match(value)):
        raise ProtocolError(f"bad {name} {value!r}")
    return value


# --- columns ------------------------------------------------------------------------------------
def to_bin(values: Any, dtype: np.dtype, name: str) -> bytes:
    """`values` (a list or an array) as `dtype` bytes; ProtocolError when they do not fit."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and type(values) is list:
        try:
            return array(code, values).tobytes()
        except (TypeError, OverflowError) as e:
            raise ProtocolError(f"{name}: {e}") from None
    try:
        arr = np.asarray(values)
        if arr.size and arr.dtype.kind not in ("iu" if dtype.kind in "iu" else "iuf"):
            raise TypeError(f"values of dtype {arr.dtype}")
        out = arr.astype(dtype, copy=False)
        if dtype.kind in "iu" and arr.size and not np.array_equal(out, arr):
            raise OverflowError(f"values outside {dtype.name}")
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"{name}: {e}") from None
    return out.tobytes()


def from_bin(raw: Any, dtype: np.dtype, count: int | None, name: str) -> np.ndarray:
    """The `dtype` array a bin field holds (`count` values, or any number when None)."""
    if type(raw) is not bytes:
        raise ProtocolError(f"{name} must be a bin array")
    _check_size(raw, dtype, count, name)
    return np.frombuffer(raw, dtype=dtype)


def _check_size(raw: bytes, dtype: np.dtype, count: int | None, name: str) -> None:
    if count is None and len(raw) % dtype.itemsize:
        raise ProtocolError(f"{name}: {len(raw)} bytes are no whole number of {dtype.name}")
    if count is not None and len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"{name}: expected {count} {dtype.name} values, got {len(raw)} bytes")


def int_list(raw: Any, count: int | None, name: str, lo: int = 0, hi: int = INT32_MAX
             ) -> list[int]:
    """An int32 bin field as a list of ints in [lo, hi]."""
    if _ARRAY_CODES and type(raw) is bytes and len(raw) <= 4096:  # short: no numpy
        _check_size(raw, I32, count, name)
        values = array("i", raw).tolist()
        if values and (min(values) < lo or max(values) > hi):
            raise ProtocolError(f"{name}: values must be in [{lo}, {hi}]")
        return values
    arr = from_bin(raw, I32, count, name)
    if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
        raise ProtocolError(f"{name}: values must be in [{lo}, {hi}]")
    return arr.tolist()


def float_list(raw: Any, count: int | None, name: str, upper_inf: bool = False) -> list[float]:
    """A float64 bin field of finite values (or +inf, with `upper_inf`) as a list."""
    if type(raw) is not bytes:
        raise ProtocolError(f"{name} must be a bin array")
    _check_size(raw, F64, count, name)
    values = array("d", raw).tolist() if _ARRAY_CODES else np.frombuffer(raw, F64).tolist()
    for x in values:
        if not (math.isfinite(x) or (upper_inf and x == math.inf)):
            raise ProtocolError(f"{name}: values must be finite" + (" or +inf" if upper_inf else ""))
    return values


def split(flat: list[Any], lengths: list[int]) -> list[list[Any]]:
    """`flat` cut into consecutive runs of `lengths` (their sum is len(flat))."""
    out, a = [], 0
    for n in lengths:
        out.append(flat[a : a + n])
        a += n
    return out
