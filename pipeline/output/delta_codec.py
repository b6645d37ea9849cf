"""The output stage's deltas (`RequestOutput`) as versioned msgpack, for the output actor -> engine
arrow: the same wire rules as the step messages (pipeline.protocol.wire), so no pickled object
crosses between the stage actors.

A message holds one step's deltas in columns, as the step messages do. For B deltas:

    rid   [str] (B)
    text  [str] (B)
    rows  bin i64[8 B]: ROW_COLUMNS one after the other, B values each: len (token ids),
          hn (histogram length), lp / top / fin (0|1: has logprobs / top_logprobs, finished),
          vct / acc / dft (spec_verify_ct, spec_accepted_tokens, spec_draft_tokens)
    ints  bin i32: one after the other, tok (sum len), tn (alternatives per token of the deltas
          with top, sum of their len), tid (sum tn), h (sum hn)
    lps   bin f64: lpv (the logprobs of the deltas with lp, sum of their len), tlp (sum tn)
    rare  [[row, finish_reason, finish_kind, matched_stop, finished_len, finish_step, error,
          cached_tokens]] for the rows where one of those is set (ascending rows)

Three typed blocks, not a map per delta or a bin per field: a step's 256 deltas are checked in a
few passes over whole columns (v1's per-delta checks cost the engine 5 us a delta, more than the
output stage spends making it), while a message of one delta (the replica's relay) costs a few
microseconds more than v1's (docs/benchmarks.md). Decoding checks every field before it builds a
delta (ProtocolError naming the field), so a bad payload yields nothing half-built.
"""

from __future__ import annotations

import math
from itertools import compress
from typing import Any

from pipeline.output.request_output import RequestOutput
from pipeline.protocol.wire import (
    F64,
    I32,
    I64,
    INT32_MAX,
    MAX_BATCH,
    MAX_RID_CHARS,
    ProtocolError,
    check_header,
    from_bin,
    int_list,
    pack,
    split,
    to_bin,
    unpack,
    want_int,
    want_str,
)

DELTAS_VERSION = 2  # 2: columns (1: one array per delta)
# RequestOutput's fields, in order: a field added to RequestOutput must get a column (or a place
# in `rare`) and the version bumped (a test compares the two).
DELTA_FIELDS = ("rid", "token_ids", "text", "logprobs", "top_logprobs", "finished",
                "finish_reason", "finish_kind", "matched_stop", "finished_len", "finish_step",
                "spec_verify_ct", "spec_accepted_tokens", "spec_acceptance_histogram",
                "spec_draft_tokens", "error", "cached_tokens")
ROW_COLUMNS = ("len", "hn", "lp", "top", "fin", "vct", "acc", "dft")
RARE_FIELDS = ("finish_reason", "finish_kind", "matched_stop", "finished_len", "finish_step",
               "error", "cached_tokens")
_PLAIN = (None,) * len(RARE_FIELDS)
_LIMIT = (1 << 62) - 1
_ROW_MAX = {"len": INT32_MAX, "hn": INT32_MAX, "lp": 1, "top": 1, "fin": 1, "vct": _LIMIT,
            "acc": _LIMIT, "dft": _LIMIT}
_KEYS = frozenset({"v", "m", "rid", "text", "rows", "ints", "lps", "rare"})
MAX_TEXT_CHARS = 1 << 24


def encode_deltas(deltas: list[RequestOutput]) -> bytes:
    lp_rows, top_n, top_pairs, rare = [], [], [], []
    for i, d in enumerate(deltas):
        n = len(d.token_ids)
        if d.logprobs is not None:
            if len(d.logprobs) != n:  # flat columns would shift the next deltas' logprobs
                raise ProtocolError(f"deltas[{i}].logprobs: {len(d.logprobs)} for {n} ids")
            lp_rows.append(d.logprobs)
        if d.top_logprobs is not None:
            if len(d.top_logprobs) != n:
                raise ProtocolError(f"deltas[{i}].top_logprobs: {len(d.top_logprobs)} for {n} ids")
            for per_token in d.top_logprobs:
                top_n.append(len(per_token))
                top_pairs += per_token
        r = (d.finish_reason, d.finish_kind, d.matched_stop, d.finished_len, d.finish_step,
             d.error, d.cached_tokens)
        if r != _PLAIN:
            rare.append([i, *r])
    top_ids, top_lps = zip(*top_pairs) if top_pairs else ((), ())
    rows = [len(d.token_ids) for d in deltas]
    rows += [len(d.spec_acceptance_histogram) for d in deltas]
    rows += [d.logprobs is not None for d in deltas]
    rows += [d.top_logprobs is not None for d in deltas]
    rows += [bool(d.finished) for d in deltas]
    rows += [d.spec_verify_ct for d in deltas]
    rows += [d.spec_accepted_tokens for d in deltas]
    rows += [d.spec_draft_tokens for d in deltas]
    ints = [t for d in deltas for t in d.token_ids]
    ints += top_n
    ints += top_ids
    ints += [c for d in deltas for c in d.spec_acceptance_histogram]
    lps = [x for row in lp_rows for x in row]
    lps += top_lps
    return pack({"v": DELTAS_VERSION, "m": "deltas", "rid": [d.rid for d in deltas],
                 "text": [d.text for d in deltas], "rows": to_bin(rows, I64, "deltas.rows"),
                 "ints": to_bin(ints, I32, "deltas.ints"), "lps": to_bin(lps, F64, "deltas.lps"),
                 "rare": rare})


def decode_deltas(payload: Any) -> list[RequestOutput]:
    msg = unpack(payload)
    check_header(msg, "deltas", DELTAS_VERSION, _KEYS)
    rids, texts = msg["rid"], msg["text"]
    if type(rids) is not list or len(rids) > MAX_BATCH:
        raise ProtocolError(f"deltas.rid must be a list of at most {MAX_BATCH} request ids")
    b = len(rids)
    _check_strs(rids, "deltas.rid", MAX_RID_CHARS, 1)
    if type(texts) is not list or len(texts) != b:
        raise ProtocolError(f"deltas.text must be a list of {b} strings")
    _check_strs(texts, "deltas.text", MAX_TEXT_CHARS, 0)
    lens, hist_lens, has_lp, has_top, finished, vct, acc, dft = _rows(msg["rows"], b)
    top_lens = list(compress(lens, has_top))
    n_tok, n_tn, n_h = sum(lens), sum(top_lens), sum(hist_lens)
    ints = int_list(msg["ints"], None, "deltas.ints")
    tok, top_n = ints[:n_tok], ints[n_tok:n_tok + n_tn]
    n_pairs = sum(top_n)
    if len(ints) != n_tok + n_tn + n_pairs + n_h:
        raise ProtocolError(f"deltas.ints: {len(ints)} values, the rows say "
                            f"{n_tok + n_tn + n_pairs + n_h}")
    top_ids = ints[n_tok + n_tn:n_tok + n_tn + n_pairs]
    hists = split(ints[n_tok + n_tn + n_pairs:], hist_lens)
    lp_lens = list(compress(lens, has_lp))
    n_lp = sum(lp_lens)
    lps = _f64_list(msg["lps"], n_lp + n_pairs, "deltas.lps")
    rare = _rare(msg["rare"], b)
    # Everything is checked: build the deltas.
    tok_rows = split(tok, lens)
    lp_iter = iter(split(lps[:n_lp], lp_lens))
    top_iter = iter(split(split(list(zip(top_ids, lps[n_lp:])), top_n), top_lens))
    out = []
    for i in range(b):
        r = rare.get(i, _PLAIN)
        out.append(RequestOutput(
            rids[i], tok_rows[i], texts[i],
            next(lp_iter) if has_lp[i] else None,
            next(top_iter) if has_top[i] else None,
            finished[i] == 1, r[0], r[1], r[2], r[3], r[4],
            vct[i], acc[i], hists[i], dft[i], r[5], r[6]))
    return out


def _rows(raw: Any, b: int) -> list[list[int]]:
    """The ROW_COLUMNS of `b` deltas, each checked: lengths in int32, flags 0|1, counts >= 0."""
    values = from_bin(raw, I64, len(ROW_COLUMNS) * b, "deltas.rows").tolist()
    cols = split(values, [b] * len(ROW_COLUMNS))
    if values and min(values) < 0:
        name = ROW_COLUMNS[values.index(min(values)) // b]
        raise ProtocolError(f"deltas.rows.{name}: values must be >= 0")
    for name, col in zip(ROW_COLUMNS, cols):
        if col and max(col) > _ROW_MAX[name]:
            raise ProtocolError(f"deltas.rows.{name}: values must be in [0, {_ROW_MAX[name]}]")
    return cols


def _check_strs(values: list[Any], name: str, max_chars: int, min_chars: int) -> None:
    for s in values:
        if type(s) is not str or not min_chars <= len(s) <= max_chars:
            raise ProtocolError(f"{name}: {s!r:.40} is not a string of {min_chars} to "
                                f"{max_chars} chars")


def _f64_list(raw: Any, count: int, name: str) -> list[float]:
    """A float64 bin field with no NaN (logprobs may be -inf) as a list."""
    values = from_bin(raw, F64, count, name).tolist()
    # one C-level sum finds any NaN (or -inf + inf); only then look value by value
    if math.isnan(sum(values)) and any(map(math.isnan, values)):
        raise ProtocolError(f"{name}: NaN")
    return values


def _rare(raw: Any, b: int) -> dict[int, tuple[Any, ...]]:
    """`rare`'s rows by delta index, each RARE_FIELDS' values, checked."""
    if type(raw) is not list or len(raw) > b:
        raise ProtocolError(f"deltas.rare must be a list of at most {b} rows")
    out: dict[int, tuple[Any, ...]] = {}
    last = -1
    for row in raw:
        if type(row) is not list or len(row) != 1 + len(RARE_FIELDS):
            raise ProtocolError(f"deltas.rare: each row must be an array of "
                                f"{1 + len(RARE_FIELDS)} fields")
        i = want_int(row[0], "deltas.rare.row", last + 1, b - 1)
        last = i
        where = f"deltas.rare[{i}]"
        reason, kind, stop, fin_len, fin_step, error, cached = row[1:]
        for name, value in (("finish_reason", reason), ("finish_kind", kind), ("error", error)):
            if value is not None:
                want_str(value, f"{where}.{name}", 4096)
        if stop is not None and type(stop) is not str:
            want_int(stop, f"{where}.matched_stop", -_LIMIT, _LIMIT)
        for name, value in (("finished_len", fin_len), ("finish_step", fin_step),
                            ("cached_tokens", cached)):
            if value is not None:
                want_int(value, f"{where}.{name}", 0, _LIMIT)
        out[i] = (reason, kind, stop, fin_len, fin_step, error, cached)
    return out
