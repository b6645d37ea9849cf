"""The verifier -> output message (VerifyStep): one verify step's accepted tokens, as msgpack.

Wire layout (a msgpack map; every array is little-endian numpy bytes in a msgpack `bin`, so a
batch costs a handful of buffer copies instead of one Python object per token):

    v     int          protocol version (PROTOCOL_VERSION)
    step  int          verify-step id
    rids  [str]        B request ids, unique
    len   bin int32[B] new_accepted_len per request (>= 1, <= drafted + 1)
    draft bin int32[B] drafted tokens per request (0 for a prefill step)
    tok   bin int32[N] accepted tokens of all requests, concatenated (N = sum(len))
    lp    bin f64[N] | nil                 target logprob of each accepted token
    tn    bin int32[B] | nil               top-N count per request (same N for all of its tokens)
    tid   bin int32[M], tlp bin f64[M]     top-N (id, logprob) of each token, M = sum(len * tn)
    tp    str | nil    W3C traceparent of the step's span
    t     float        unix time verification finished
    ch    bin int32[B]   optional: per request, prompt tokens whose KV came from the prefix cache
                       (its prefill row; 0 on verify rows); sent on steps that prefill

`decode` checks everything before anything is built, so a bad payload raises ProtocolError and
nothing downstream is half-applied. No pickle anywhere.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import msgpack
import numpy as np

from pipeline.protocol.wire import (
    MAX_BATCH,
    MAX_DRAFTED,
    MAX_PAYLOAD_BYTES,
    MAX_RID_CHARS,
    ProtocolError,
    unpack,
)

PROTOCOL_VERSION = 1
MAX_TOP_N = 20
_KEYS = frozenset({"v", "step", "rids", "len", "draft", "tok", "lp", "tn", "tid", "tlp", "tp", "t"})
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_I32 = np.dtype("<i4")
_I32_MAX = int(np.iinfo(_I32).max)  # once: np.iinfo builds an object a call
_F64 = np.dtype("<f8")


@dataclass
class VerifyStep:
    step: int
    rids: list[str]
    token_ids: list[list[int]]
    drafted: list[int]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    traceparent: str | None = None
    time: float = 0.0


@dataclass
class StepColumns:
    """A validated verify step in columnar form (what the output path works on).

    Request i's tokens are `tokens[offsets[i]:offsets[i+1]]`; its top-N entries for those tokens are
    `top_ids[top_offsets[i]:top_offsets[i+1]]` reshaped to `[lengths[i], top_n[i]]`.
    """

    step: int
    rids: list[str]
    lengths: np.ndarray  # int64 [B]
    drafted: np.ndarray  # int64 [B]
    tokens: np.ndarray  # int64 [N]
    logprobs: np.ndarray | None = None  # float64 [N]
    top_n: np.ndarray | None = None  # int64 [B]
    top_ids: np.ndarray | None = None  # int64 [M]
    top_logprobs: np.ndarray | None = None  # float64 [M]
    traceparent: str | None = None
    time: float = 0.0
    cached: np.ndarray | None = None  # int64 [B], optional (`ch`): prefix-cache hits per row

    def __post_init__(self) -> None:
        self.offsets = np.zeros(len(self.rids) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        if self.top_n is not None:
            self.top_offsets = np.zeros(len(self.rids) + 1, dtype=np.int64)
            np.cumsum(self.lengths * self.top_n, out=self.top_offsets[1:])

    @property
    def batch_size(self) -> int:
        return len(self.rids)

    def to_step(self) -> VerifyStep:
        bounds = self.offsets.tolist()
        flat = self.tokens.tolist()
        token_ids = [flat[a:b] for a, b in itertools.pairwise(bounds)]
        logprobs = None
        if self.logprobs is not None:
            lps = self.logprobs.tolist()
            logprobs = [lps[a:b] for a, b in itertools.pairwise(bounds)]
        top = None
        if self.top_n is not None:
            top = []
            ids, lps = self.top_ids.tolist(), self.top_logprobs.tolist()
            tb = self.top_offsets.tolist()
            for i, n in enumerate(self.top_n.tolist()):
                a = tb[i]
                per_token = []
                for _ in range(int(self.lengths[i])):
                    per_token.append(list(zip(ids[a : a + n], lps[a : a + n])))
                    a += n
                top.append(per_token)
        return VerifyStep(
            step=self.step,
            rids=list(self.rids),
            token_ids=token_ids,
            drafted=self.drafted.tolist(),
            logprobs=logprobs,
            top_logprobs=top,
            traceparent=self.traceparent,
            time=self.time,
        )


def encode(step: VerifyStep) -> bytes:
    return encode_columns(columns_from_step(step))


def decode(payload: bytes) -> VerifyStep:
    return decode_columns(payload).to_step()


def columns_from_step(step: VerifyStep) -> StepColumns:
    """Flatten a VerifyStep; raises ProtocolError when its lists don't line up."""
    try:
        return _columns_from_step(step)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"malformed VerifyStep: {e}") from None


def _columns_from_step(step: VerifyStep) -> StepColumns:
    b = len(step.rids)
    if len(step.token_ids) != b or len(step.drafted) != b:
        raise ProtocolError("rids, token_ids and drafted must have the same length")
    lengths = np.fromiter((len(t) for t in step.token_ids), dtype=np.int64, count=b)
    tokens = _array(itertools.chain.from_iterable(step.token_ids), np.int64, "token_ids")
    logprobs = None
    if step.logprobs is not None:
        if len(step.logprobs) != b or any(
            len(lp) != n for lp, n in zip(step.logprobs, lengths.tolist())
        ):
            raise ProtocolError("logprobs must align with token_ids")
        logprobs = _array(itertools.chain.from_iterable(step.logprobs), np.float64, "logprobs")
    top_n = top_ids = top_lps = None
    if step.top_logprobs is not None:
        if len(step.top_logprobs) != b:
            raise ProtocolError("top_logprobs must have one entry per request")
        counts, ids, lps = [], [], []
        for per_req, n_tok in zip(step.top_logprobs, lengths.tolist()):
            if len(per_req) != n_tok:
                raise ProtocolError("top_logprobs must align with token_ids")
            n = len(per_req[0]) if per_req else 0
            for entries in per_req:
                if len(entries) != n:
                    raise ProtocolError("top_logprobs: one request's tokens need the same top-N")
                for entry in entries:
                    if len(entry) != 2:
                        raise ProtocolError("top_logprobs entries must be (token id, logprob)")
                    ids.append(entry[0])
                    lps.append(entry[1])
            counts.append(n)
        top_n = np.asarray(counts, dtype=np.int64)
        top_ids = _array(ids, np.int64, "top_logprobs ids")
        top_lps = _array(lps, np.float64, "top_logprobs values")
    cols = StepColumns(
        step=step.step,
        rids=list(step.rids),
        lengths=lengths,
        drafted=_array(step.drafted, np.int64, "drafted"),
        tokens=tokens,
        logprobs=logprobs,
        top_n=top_n,
        top_ids=top_ids,
        top_logprobs=top_lps,
        traceparent=step.traceparent,
        time=step.time,
    )
    validate_columns(cols)
    return cols


def encode_columns(cols: StepColumns) -> bytes:
    validate_columns(cols)
    msg = {
        "v": PROTOCOL_VERSION,
        "step": int(cols.step),
        "rids": list(cols.rids),
        "len": cols.lengths.astype(_I32).tobytes(),
        "draft": cols.drafted.astype(_I32).tobytes(),
        "tok": cols.tokens.astype(_I32).tobytes(),
        "lp": None if cols.logprobs is None else cols.logprobs.astype(_F64).tobytes(),
        "tn": None if cols.top_n is None else cols.top_n.astype(_I32).tobytes(),
        "tid": None if cols.top_n is None else cols.top_ids.astype(_I32).tobytes(),
        "tlp": None if cols.top_n is None else cols.top_logprobs.astype(_F64).tobytes(),
        "tp": cols.traceparent,
        "t": float(cols.time),
    }
    if cols.cached is not None:
        msg["ch"] = cols.cached.astype(_I32).tobytes()
    return msgpack.packb(msg, use_bin_type=True)


def decode_columns(payload: bytes) -> StepColumns:
    """Parse and validate one message. Raises ProtocolError on anything malformed."""
    msg = unpack(payload)
    v = msg.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # True == 1 and 1.0 == 1: not versions
        raise ProtocolError(f"unsupported protocol version {v!r}")
    if set(msg) - {"ch"} != _KEYS:
        raise ProtocolError(f"message keys {sorted(map(str, msg))} != {sorted(_KEYS)}")
    rids = msg["rids"]
    if not isinstance(rids, list):
        raise ProtocolError("rids must be a list")
    b = len(rids)
    lengths = _from_bin(msg["len"], _I32, b, "len")
    top_n = None if msg["tn"] is None else _from_bin(msg["tn"], _I32, b, "tn")
    if b and (int(lengths.min()) < 1 or int(lengths.max()) > MAX_DRAFTED + 1):
        raise ProtocolError(f"len: every new_accepted_len must be in [1, {MAX_DRAFTED + 1}]")
    if top_n is not None and b and (int(top_n.min()) < 0 or int(top_n.max()) > MAX_TOP_N):
        raise ProtocolError(f"tn: top-N must be in [0, {MAX_TOP_N}]")
    n_tok = int(lengths.sum()) if b else 0
    if n_tok < 0 or n_tok > MAX_PAYLOAD_BYTES:
        raise ProtocolError("len: invalid token counts")
    n_top = int((lengths * top_n).sum()) if top_n is not None and b else 0
    for key in ("tid", "tlp"):
        if (msg[key] is None) != (top_n is None):
            raise ProtocolError(f"{key} must be present exactly when tn is")
    cols = StepColumns(
        step=msg["step"],
        rids=rids,
        lengths=lengths,
        drafted=_from_bin(msg["draft"], _I32, b, "draft"),
        tokens=_from_bin(msg["tok"], _I32, n_tok, "tok"),
        logprobs=None if msg["lp"] is None else _from_bin(msg["lp"], _F64, n_tok, "lp"),
        top_n=top_n,
        top_ids=None if top_n is None else _from_bin(msg["tid"], _I32, n_top, "tid"),
        top_logprobs=None if top_n is None else _from_bin(msg["tlp"], _F64, n_top, "tlp"),
        traceparent=msg["tp"],
        time=msg["t"],
        cached=_from_bin(msg["ch"], _I32, b, "ch") if "ch" in msg else None,
    )
    validate_columns(cols)
    return cols


def validate_columns(cols: StepColumns) -> None:
    """Every rule of the contract; raises ProtocolError naming the first broken one."""
    if isinstance(cols.step, bool) or not isinstance(cols.step, int) or cols.step < 0:
        raise ProtocolError(f"step must be a non-negative integer, got {cols.step!r}")
    b = len(cols.rids)
    if b > MAX_BATCH:
        raise ProtocolError(f"batch of {b} exceeds {MAX_BATCH}")
    # the type check first (map(len) needs sized items); C-level passes, not a generator
    if b and not (
        set(map(type, cols.rids)) == {str}
        and 0 < min(lens := list(map(len, cols.rids)))
        and max(lens) <= MAX_RID_CHARS
    ):
        bad = next(
            r for r in cols.rids if not isinstance(r, str) or not 0 < len(r) <= MAX_RID_CHARS
        )
        raise ProtocolError(f"bad request id {bad!r}")
    if len(set(cols.rids)) != b:
        raise ProtocolError("duplicate request ids in one step")
    if cols.lengths.shape != (b,) or cols.drafted.shape != (b,):
        raise ProtocolError("len and draft must have one entry per request")
    if b and int(cols.lengths.min()) < 1:
        raise ProtocolError("every request needs new_accepted_len >= 1")
    if b and (int(cols.drafted.min()) < 0 or int(cols.drafted.max()) > MAX_DRAFTED):
        raise ProtocolError(f"drafted must be in [0, {MAX_DRAFTED}]")
    if b and bool((cols.lengths > cols.drafted + 1).any()):
        i = int(np.argmax(cols.lengths > cols.drafted + 1))
        raise ProtocolError(
            f"request {cols.rids[i]!r}: {int(cols.lengths[i])} tokens for "
            f"{int(cols.drafted[i])} drafted (at most drafted + 1)"
        )
    n_tok = int(cols.lengths.sum()) if b else 0
    if cols.tokens.shape != (n_tok,):
        raise ProtocolError(f"expected {n_tok} tokens, got {cols.tokens.shape[0]}")
    if n_tok and (int(cols.tokens.min()) < 0 or int(cols.tokens.max()) > _I32_MAX):
        raise ProtocolError("token ids must be non-negative int32")
    if cols.logprobs is not None:
        if cols.logprobs.shape != (n_tok,):
            raise ProtocolError("logprobs must align with tokens")
        if not bool(np.isfinite(cols.logprobs).all()):
            raise ProtocolError("logprobs must be finite")
    if (cols.top_ids is None or cols.top_logprobs is None) != (cols.top_n is None):
        raise ProtocolError("top-N counts, ids and logprobs must be present together")
    if cols.top_n is not None:
        if cols.top_n.shape != (b,):
            raise ProtocolError("tn must have one entry per request")
        if b and (int(cols.top_n.min()) < 0 or int(cols.top_n.max()) > MAX_TOP_N):
            raise ProtocolError(f"top-N must be in [0, {MAX_TOP_N}]")
        n_top = int((cols.lengths * cols.top_n).sum()) if b else 0
        if cols.top_ids.shape != (n_top,) or cols.top_logprobs.shape != (n_top,):
            raise ProtocolError("top logprob arrays must hold len * top-N entries")
        if n_top and (int(cols.top_ids.min()) < 0 or int(cols.top_ids.max()) > _I32_MAX):
            raise ProtocolError("top logprob ids must be non-negative int32")
        if not bool(np.isfinite(cols.top_logprobs).all()):
            raise ProtocolError("top logprobs must be finite")
    if cols.cached is not None and (cols.cached.shape != (b,) or
                                    (b and int(cols.cached.min()) < 0)):
        raise ProtocolError("ch (cached tokens) must be one non-negative count per request")
    tp = cols.traceparent
    if tp is not None and (not isinstance(tp, str) or not _TRACEPARENT.match(tp)):
        raise ProtocolError(f"bad traceparent {tp!r}")
    t = cols.time
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ProtocolError(f"time must be a finite non-negative number, got {t!r}")


def _from_bin(raw: object, dtype: np.dtype, count: int, key: str) -> np.ndarray:
    if not isinstance(raw, bytes):
        raise ProtocolError(f"{key} must be a bin array")
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"{key}: expected {count} values, got {len(raw)} bytes")
    wide = np.int64 if dtype.kind == "i" else np.float64
    return np.frombuffer(raw, dtype=dtype).astype(wide)


def _array(values, dtype, name: str) -> np.ndarray:
    """A 1-D array of `values`; ints must be ints (no bools, floats or strings), floats numbers."""
    try:
        out = np.array(list(values))
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"{name}: {e}") from None
    if out.size == 0:
        return np.zeros(0, dtype=dtype)
    allowed = "iu" if np.dtype(dtype).kind == "i" else "iuf"
    if out.ndim != 1 or out.dtype.kind not in allowed:
        raise ProtocolError(f"{name}: expected a flat list of {np.dtype(dtype).name} values")
    try:
        return out.astype(dtype, casting="safe" if out.dtype.kind != "u" else "unsafe")
    except TypeError as e:
        raise ProtocolError(f"{name}: {e}") from None
