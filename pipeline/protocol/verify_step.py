"""The verifier -> output message (VerifyStep): one verify step's accepted tokens, as msgpack
(`COLUMNS`: every array a little-endian `bin`, all requests' tokens in one, so a batch costs a
few buffer copies, not an object per token). Checked whole both ways (`validate_columns`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.protocol.wire import (
    F64,
    I32,
    INT32_MAX,
    MAX_BATCH,
    MAX_DRAFTED,
    MAX_RID_CHARS,
    TRACEPARENT_RE,
    Codec,
    Field,
    Kind,
    ProtocolError,
    column,
    per,
)

PROTOCOL_VERSION = 1
MAX_TOP_N = 20


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
    if n_tok and (int(cols.tokens.min()) < 0 or int(cols.tokens.max()) > INT32_MAX):
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
        if n_top and (int(cols.top_ids.min()) < 0 or int(cols.top_ids.max()) > INT32_MAX):
            raise ProtocolError("top logprob ids must be non-negative int32")
        if not bool(np.isfinite(cols.top_logprobs).all()):
            raise ProtocolError("top logprobs must be finite")
    if cols.cached is not None and (cols.cached.shape != (b,) or
                                    (b and int(cols.cached.min()) < 0)):
        raise ProtocolError("ch (cached tokens) must be one non-negative count per request")
    tp = cols.traceparent
    if tp is not None and (not isinstance(tp, str) or not TRACEPARENT_RE.match(tp)):
        raise ProtocolError(f"bad traceparent {tp!r}")
    t = cols.time
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ProtocolError(f"time must be a finite non-negative number, got {t!r}")


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


def _load_rids(raw: Any, name: str, got: dict[str, Any]) -> list[str]:
    if not isinstance(raw, list):
        raise ProtocolError(f"{name} must be a list")
    return raw


def _n_top(got: dict[str, Any], raw: Any) -> int | None:
    top_n = got["top_n"]
    return None if top_n is None else int((got["lengths"] * top_n).sum())


def _n_tok(got: dict[str, Any], raw: Any) -> int:
    return int(got["lengths"].sum())


_B = per("rids")
_PER_TOKEN = per("tokens")  # (its count is checked by then)


def _per_top(got: dict[str, Any], raw: Any) -> int | None:
    return None if got["top_ids"] is None else len(got["top_ids"])

# StepColumns on the wire (the columns are checked whole by validate_columns, both ways)
COLUMNS = Codec(StepColumns, {"v": PROTOCOL_VERSION}, [
    Field("step", "step", Kind(lambda v, attr: int(v))),
    Field("rids", "rids", Kind(lambda v, attr: list(v), _load_rids)),
    Field("lengths", "len", column(I32, _B, 1, MAX_DRAFTED + 1)),
    Field("drafted", "draft", column(I32, _B)),
    Field("tokens", "tok", column(I32, _n_tok)),
    Field("logprobs", "lp", column(F64, _PER_TOKEN, optional=True)),
    Field("top_n", "tn", column(I32, _B, 0, MAX_TOP_N, optional=True)),
    Field("top_ids", "tid", column(I32, _n_top, optional=True)),
    Field("top_logprobs", "tlp", column(F64, _per_top, optional=True)),
    Field("traceparent", "tp"),
    Field("time", "t", Kind(lambda v, attr: float(v))),
    Field("cached", "ch", column(I32, _B), omit_none=True),  # sent on steps that prefill
], before=validate_columns, check=lambda cols, where: validate_columns(cols), what="verify")
encode_columns = COLUMNS.encode
decode_columns = COLUMNS.decode  # ProtocolError, naming the rule, for anything malformed
