"""The output stage's deltas (`RequestOutput`) as versioned msgpack, output actor -> engine,
in typed columns, not a map per delta (that cost the engine 5 us a delta): `rows` (ROW_COLUMNS,
B int64 each), `ints` (tok, tn, tid, h), `lps` (lpv, tlp), `rare` ([row, *RARE] where one is set).
"""

from __future__ import annotations

import math
from itertools import compress
from typing import Any, NamedTuple

from pipeline.output.request_output import RequestOutput
from pipeline.protocol.wire import (
    F64,
    I32,
    I64,
    INT32_MAX,
    MAX_BATCH,
    MAX_RID_CHARS,
    Codec,
    Field,
    Kind,
    ProtocolError,
    from_bin,
    int_list,
    split,
    to_bin,
    want_int,
    want_str,
)

DELTAS_VERSION = 2  # 2: columns (1: one array per delta)
# RequestOutput's fields in order (a test compares): a new one gets a column or a RARE line
DELTA_FIELDS = ("rid", "token_ids", "text", "logprobs", "top_logprobs", "finished",
                "finish_reason", "finish_kind", "matched_stop", "finished_len", "finish_step",
                "spec_verify_ct", "spec_accepted_tokens", "spec_acceptance_histogram",
                "spec_draft_tokens", "error", "cached_tokens")
ROW_COLUMNS = ("len", "hn", "lp", "top", "fin", "vct", "acc", "dft")
_LIMIT = (1 << 62) - 1
_ROW_MAX = (INT32_MAX, INT32_MAX, 1, 1, 1, _LIMIT, _LIMIT, _LIMIT)
MAX_TEXT_CHARS = 1 << 24


_text = lambda v, name: want_str(v, name, 4096)
_count = lambda v, name: want_int(v, name, 0, _LIMIT)
# The fields most deltas leave None, sent only for the rows that set one: field -> its check.
RARE = {"finish_reason": _text, "finish_kind": _text,
        "matched_stop": lambda v, name: type(v) is str or want_int(v, name, -_LIMIT, _LIMIT),
        "finished_len": _count, "finish_step": _count, "error": _text, "cached_tokens": _count}
RARE_FIELDS = tuple(RARE)
# the RARE values of a delta: attribute loads, not attrgetter (a third of the encoder's time)
_rare_of = eval(f"lambda d: ({''.join(f'd.{f}, ' for f in RARE)})")
_PLAIN = (None,) * len(RARE_FIELDS)


class _Columns(NamedTuple):
    rid: list[str]
    text: list[str]
    rows: list[list[int]]
    ints: list[int]
    lps: list[float]
    rare: Any  # out: rows [i, *RARE values]; in: {i: RARE values}


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
        r = _rare_of(d)
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
    return DELTAS.encode(_Columns([d.rid for d in deltas], [d.text for d in deltas], rows, ints,
                                  lps, rare))


def decode_deltas(payload: Any) -> list[RequestOutput]:
    rids, texts, rows, ints, lps, rare = DELTAS.decode(payload)
    lens, hist_lens, has_lp, has_top, finished, vct, acc, dft = rows
    top_lens = list(compress(lens, has_top))
    n_tok, n_tn, n_h = sum(lens), sum(top_lens), sum(hist_lens)
    top_n = ints[n_tok:n_tok + n_tn]
    n_pairs = sum(top_n)
    if len(ints) != n_tok + n_tn + n_pairs + n_h:
        raise ProtocolError(f"deltas.ints: {len(ints)} values, the rows say "
                            f"{n_tok + n_tn + n_pairs + n_h}")
    lp_lens = list(compress(lens, has_lp))
    n_lp = sum(lp_lens)
    if len(lps) != n_lp + n_pairs:
        raise ProtocolError(f"deltas.lps: expected {n_lp + n_pairs} float64 values, got "
                            f"{len(lps)}")
    tok_rows = split(ints[:n_tok], lens)
    hists = split(ints[n_tok + n_tn + n_pairs:], hist_lens)
    lp_iter = iter(split(lps[:n_lp], lp_lens))
    top_pairs = list(zip(ints[n_tok + n_tn:n_tok + n_tn + n_pairs], lps[n_lp:]))
    top_iter = iter(split(split(top_pairs, top_n), top_lens))
    out = []
    for i, rid in enumerate(rids):  # positional: RequestOutput's order is DELTA_FIELDS'
        out.append(RequestOutput(
            rid, tok_rows[i], texts[i], next(lp_iter) if has_lp[i] else None,
            next(top_iter) if has_top[i] else None, finished[i] == 1, None, None, None, None,
            None, vct[i], acc[i], hists[i], dft[i]))
    for i, values in rare.items():
        out[i].__dict__.update(zip(RARE_FIELDS, values))
    return out


def _load_rids(raw: Any, name: str, got: dict[str, Any]) -> list[str]:
    if type(raw) is not list or len(raw) > MAX_BATCH:
        raise ProtocolError(f"{name} must be a list of at most {MAX_BATCH} request ids")
    _check_strs(raw, name, MAX_RID_CHARS, 1)
    return raw


def _load_texts(raw: Any, name: str, got: dict[str, Any]) -> list[str]:
    if type(raw) is not list or len(raw) != len(got["rid"]):
        raise ProtocolError(f"{name} must be a list of {len(got['rid'])} strings")
    _check_strs(raw, name, MAX_TEXT_CHARS, 0)
    return raw


def _check_strs(values: list[Any], name: str, max_chars: int, min_chars: int) -> None:
    for s in values:
        if type(s) is not str or not min_chars <= len(s) <= max_chars:
            raise ProtocolError(f"{name}: {s!r:.40} is not a string of {min_chars} to "
                                f"{max_chars} chars")


def _load_rows(raw: Any, name: str, got: dict[str, Any]) -> list[list[int]]:
    """The ROW_COLUMNS of the deltas, each checked: lengths in int32, flags 0|1, counts >= 0."""
    b = len(got["rid"])
    values = from_bin(raw, I64, len(ROW_COLUMNS) * b, name).tolist()
    cols = split(values, [b] * len(ROW_COLUMNS))
    if values and min(values) < 0:
        raise ProtocolError(f"{name}.{ROW_COLUMNS[values.index(min(values)) // b]}: values "
                            "must be >= 0")
    for col_name, col, most in zip(ROW_COLUMNS, cols, _ROW_MAX):
        if col and max(col) > most:
            raise ProtocolError(f"{name}.{col_name}: values must be in [0, {most}]")
    return cols


def _load_lps(raw: Any, name: str, got: dict[str, Any]) -> list[float]:
    values = from_bin(raw, F64, None, name).tolist()
    # one C-level sum finds any NaN (or -inf + inf); only then look value by value
    if math.isnan(sum(values)) and any(map(math.isnan, values)):
        raise ProtocolError(f"{name}: NaN")
    return values


def _load_rare(raw: Any, name: str, got: dict[str, Any]) -> dict[int, tuple[Any, ...]]:
    b = len(got["rid"])
    if type(raw) is not list or len(raw) > b:
        raise ProtocolError(f"{name} must be a list of at most {b} rows")
    out: dict[int, tuple[Any, ...]] = {}
    last = -1
    for row in raw:
        if type(row) is not list or len(row) != 1 + len(RARE):
            raise ProtocolError(f"{name}: each row must be an array of {1 + len(RARE)} fields")
        last = i = want_int(row[0], f"{name}.row", last + 1, b - 1)
        for (field, check), value in zip(RARE.items(), row[1:]):
            if value is not None:
                check(value, f"{name}[{i}].{field}")
        out[i] = tuple(row[1:])
    return out


DELTAS = Codec(_Columns, {"v": DELTAS_VERSION, "m": "deltas"}, [
    Field("rid", "rid", Kind(None, _load_rids)),
    Field("text", "text", Kind(None, _load_texts)),
    Field("rows", "rows", Kind(lambda v, attr: to_bin(v, I64, "deltas.rows"), _load_rows)),
    Field("ints", "ints", Kind(lambda v, attr: to_bin(v, I32, "deltas.ints"),
                               lambda raw, name, got: int_list(raw, None, name))),
    Field("lps", "lps", Kind(lambda v, attr: to_bin(v, F64, "deltas.lps"), _load_lps)),
    Field("rare", "rare", Kind(None, _load_rare)),
])
