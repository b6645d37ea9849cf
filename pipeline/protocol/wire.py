"""The wire rules every message shares (a msgpack map with a version tag, number columns as
little-endian `bin`s, strict checks on the way in: ProtocolError naming the field), and `Codec`:
a message's encoder and decoder from one table of its fields (dataclass field, wire key, kind)."""

from __future__ import annotations

import math
import re
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass
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
TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class ProtocolError(ValueError):
    """A malformed step message."""


def pack(msg: dict[str, Any]) -> bytes:
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # a field of a type msgpack cannot carry
        raise ProtocolError(f"cannot encode {msg.get('m', 'message')!r}: {e}") from None


def unpack(payload: Any, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict[str, Any]:
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


def check_keys(msg: Any, keys: frozenset[str], what: str, optional: frozenset[str] = frozenset()
               ) -> None:
    if not isinstance(msg, dict):
        raise ProtocolError(f"{what} must be a map")
    if not keys - optional <= set(msg) <= keys:
        missing = sorted(keys - optional - set(msg))
        unknown = sorted(map(str, set(msg) - keys))
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


def want_str(value: Any, name: str, max_chars: int) -> str:
    if type(value) is not str or len(value) > max_chars:
        raise ProtocolError(f"{name} must be a string of at most {max_chars} chars")
    return value


def want_rids(value: Any, name: str) -> list[str]:
    if type(value) is not list or len(value) > MAX_BATCH:
        raise ProtocolError(f"{name} must be a list of at most {MAX_BATCH} request ids")
    for rid in value:
        if type(rid) is not str or not 0 < len(rid) <= MAX_RID_CHARS:
            raise ProtocolError(f"{name}: bad request id {rid!r}")
    return value


def want_traceparent(value: Any, name: str = "traceparent") -> str | None:
    if value is not None and (type(value) is not str or not TRACEPARENT_RE.match(value)):
        raise ProtocolError(f"bad {name} {value!r}")
    return value


# --- columns ------------------------------------------------------------------------------------
def to_bin(values: Any, dtype: np.dtype, name: str) -> bytes:
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
    if type(raw) is not bytes:
        raise ProtocolError(f"{name} must be a bin array")
    _check_size(raw, F64, count, name)
    values = array("d", raw).tolist() if _ARRAY_CODES else np.frombuffer(raw, F64).tolist()
    for x in values:
        if not (math.isfinite(x) or (upper_inf and x == math.inf)):
            raise ProtocolError(f"{name}: values must be finite" + (" or +inf" if upper_inf else ""))
    return values


def split(flat: list[Any], lengths: list[int]) -> list[list[Any]]:
    out, a = [], 0
    for n in lengths:
        out.append(flat[a : a + n])
        a += n
    return out


# --- declarative codecs -------------------------------------------------------------------------
Dump = Callable[[Any, str], Any]  # (value, field name) -> wire value (a tuple: several keys)
Load = Callable[[Any, Any, dict[str, Any]], Any]  # (wire value(s), name(s), fields so far)
Count = Callable[[dict[str, Any], Any], int | None]  # (fields so far, wire value) -> its length


@dataclass(frozen=True)
class Kind:
    dump: Dump | None = None  # None: as it is
    load: Load | None = None


@dataclass(frozen=True)
class Field:
    attr: str
    key: str | tuple[str, ...]
    kind: Kind = Kind()
    omit_none: bool = False  # an optional key: left off when None


class Codec:
    """`header` ({"v": version, "m": kind}) then `fields`, in wire order; `before(obj)` and
    `check(obj, where)` check across fields. Its functions are generated from the table (as
    dataclasses' `__init__`): they run per step, and a loop over the table cost a fifth more."""

    def __init__(self, cls: type, header: dict[str, Any], fields: list[Field],
                 before: Callable[[Any], None] | None = None,
                 check: Callable[[Any, str], None] | None = None,
                 max_bytes: int = MAX_PAYLOAD_BYTES, what: str = "", first: tuple[str, ...] = ()
                 ) -> None:
        self.cls, self.header, self.fields = cls, header, fields
        self.first = first  # decoded first: a field before them reads them
        self.before, self.check, self.max_bytes = before, check, max_bytes
        self.what = what or header.get("m", cls.__name__)
        self.body_keys = frozenset(k for f in fields for k in _keys(f))
        self.keys = self.body_keys | set(header)
        self.required = self.keys - {f.key for f in fields if f.omit_none}
        if [f.omit_none for f in fields] != sorted(f.omit_none for f in fields):
            raise ValueError("optional keys come last")
        self.body = self._compile_body({})
        self.encode: Callable[[Any], bytes] = self._compile_body(header)
        self._builds = {self.what: self._compile_build(self.what)}

    def decode(self, payload: Any) -> Any:
        msg = unpack(payload, self.max_bytes)
        kind, v = self.header.get("m"), self.header["v"]
        if kind is not None and msg.get("m") != kind:
            raise ProtocolError(f"expected a {kind!r} message, got {msg.get('m')!r}")
        if type(msg.get("v")) is not int or msg["v"] != v:  # True == 1 and 1.0 == 1: not versions
            raise ProtocolError(f"{self.what}: unsupported version {msg.get('v')!r} "
                                f"(this reader knows {v})")
        if not self.required <= msg.keys() <= self.keys:
            check_keys(msg, self.keys, self.what, frozenset(self.keys - self.required))
        return self._builds[self.what](msg)

    def load_body(self, raw: Any, where: str) -> Any:
        if type(raw) is not dict or raw.keys() != self.body_keys:
            check_keys(raw, self.body_keys, where)
        build = self._builds.get(where)
        if build is None:
            build = self._builds[where] = self._compile_build(where)
        return build(raw)

    def _compile_body(self, header: dict[str, Any]) -> Callable[..., Any]:
        env: dict[str, Any] = {"before": self.before, "pack": pack}
        lines, items, late = ["def f(obj):"], [f"{k!r}: {v!r}" for k, v in header.items()], []
        if self.before is not None:
            lines.append(" before(obj)")
        for i, f in enumerate(self.fields):
            value = f"obj.{f.attr}"
            if f.kind.dump is not None:
                env[f"d{i}"] = f.kind.dump
                value = f"d{i}({value}, {f.attr!r})"
            if type(f.key) is not str:
                lines.append(f" t{i} = {value}")
                items += [f"{k!r}: t{i}[{j}]" for j, k in enumerate(f.key)]
            elif f.omit_none:
                late.append(f" x = {value}\n if x is not None: msg[{f.key!r}] = x")
            else:
                items.append(f"{f.key!r}: {value}")
        lines += [f" msg = {{{', '.join(items)}}}", *late]
        lines.append(" return pack(msg)" if header else " return msg")
        return _define(lines, env)["f"]

    def _compile_build(self, where: str) -> Callable[[dict[str, Any]], Any]:
        prefix = f"{where}." if where else ""
        env: dict[str, Any] = {"cls": self.cls, "check": self.check}
        lines = ["def build(msg):", " got = {}"]
        for i, f in enumerate(sorted(self.fields, key=lambda f: f.attr not in self.first)):
            if type(f.key) is str:
                raw, name = f"msg[{f.key!r}]", repr(prefix + f.key)
            else:
                raw = f"({', '.join(f'msg[{k!r}]' for k in f.key)},)"
                name = repr(tuple(prefix + k for k in f.key))
            if f.kind.load is not None:
                env[f"l{i}"] = f.kind.load
                raw = f"l{i}({raw}, {name}, got)"
            if f.omit_none:
                raw = f"{raw} if {f.key!r} in msg else None"
            lines.append(f" got[{f.attr!r}] = {raw}")
        lines.append(" obj = cls(**got)")
        if self.check is not None:
            lines.append(f" check(obj, {where!r})")
        return _define(lines + [" return obj"], env)["build"]


def _keys(f: Field) -> tuple[str, ...]:
    return (f.key,) if type(f.key) is str else f.key


def _define(lines: list[str], env: dict[str, Any]) -> dict[str, Any]:
    exec("\n".join(lines), env)  # noqa: S102 - source made above from the table, no input
    return env


def per(attr: str, or_none: bool = False) -> Count:
    return lambda got, raw: 0 if or_none and raw == b"" else len(got[attr])



def integer(lo: int = 0, hi: int = INT32_MAX, optional: bool = False) -> Kind:
    def load(raw: Any, name: str, got: dict[str, Any]) -> int | None:
        if type(raw) is int and lo <= raw <= hi or optional and raw is None:
            return raw
        return want_int(raw, name, lo, hi)

    return Kind(None, load)


def number(lo: float = -math.inf, optional: bool = False) -> Kind:
    def load(raw: Any, name: str, got: dict[str, Any]) -> float | None:
        if type(raw) is float and lo <= raw < math.inf or optional and raw is None:
            return raw
        return want_float(raw, name, lo)

    return Kind(None, load)


def text(max_chars: int) -> Kind:
    return Kind(None, lambda raw, name, got: want_str(raw, name, max_chars))


RIDS = Kind(None, lambda raw, name, got: want_rids(raw, name))
RID = Kind(None, lambda raw, name, got: want_rids([raw], name)[0])
TRACEPARENT = Kind(None, lambda raw, name, got: want_traceparent(raw, name))


def ints(count: Count | None = None, lo: int = 0, hi: int = INT32_MAX) -> Kind:
    return Kind(lambda v, attr: to_bin(v, I32, attr),
                lambda raw, name, got: int_list(raw, count and count(got, raw), name, lo, hi))


def floats(count: Count | None = None, upper_inf: bool = False) -> Kind:
    return Kind(lambda v, attr: to_bin(v, F64, attr),
                lambda raw, name, got: float_list(raw, count and count(got, raw), name, upper_inf))


def ragged(count: Count | None, lo: int, hi: int,
           check: Callable[[list[int], dict[str, Any]], None] | None = None) -> Kind:
    """Lists of ints as two int32 bins: their lengths, then all of them in a row."""
    def load(raw: tuple[Any, Any], names: tuple[str, str], got: dict[str, Any]
             ) -> list[list[int]]:
        lengths = int_list(raw[0], count and count(got, raw[0]), names[0], lo, hi)
        if len(lengths) > MAX_BATCH:
            raise ProtocolError(f"{names[0]}: batch of {len(lengths)} exceeds {MAX_BATCH}")
        if check is not None:
            check(lengths, got)
        return split(int_list(raw[1], sum(lengths), names[1]), lengths)

    return Kind(lambda v, attr: (to_bin([len(t) for t in v], I32, attr),
                                 to_bin([t for ts in v for t in ts], I32, attr)), load)


def column(dtype: np.dtype, count: Count, lo: int | None = None, hi: int | None = None,
           optional: bool = False) -> Kind:
    """A numpy column (int64 or float64 in memory) as a `dtype` bin."""
    wide = np.dtype(np.int64 if dtype.kind == "i" else np.float64)

    def load(raw: Any, name: str, got: dict[str, Any]) -> np.ndarray | None:
        if optional and raw is None:
            return None
        arr = from_bin(raw, dtype, count(got, raw), name).astype(wide)
        if lo is not None and arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
            raise ProtocolError(f"{name}: values must be in [{lo}, {hi}]")
        return arr

    return Kind(lambda v, attr: None if v is None else v.astype(dtype).tobytes(), load)
