"""The output stage's deltas (`RequestOutput`) as versioned msgpack, for the output actor -> engine
arrow: the same wire rules as the step messages (pipeline.protocol.wire), so no pickled object
crosses between the stage actors.

A message holds one step's deltas, each a msgpack array in DELTA_FIELDS order; numbers in
columns travel as int32 / float64 bins. Decoding checks every field before it builds a delta
(ProtocolError naming the field), so a bad payload yields nothing half-built.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.output.request_output import RequestOutput
from pipeline.protocol.wire import (
    F64,
    I32,
    MAX_BATCH,
    ProtocolError,
    check_header,
    from_bin,
    int_list,
    pack,
    to_bin,
    unpack,
    want_bool,
    want_int,
    want_rids,
    want_str,
)

DELTAS_VERSION = 1
# RequestOutput's fields on the wire, in order: a field added to RequestOutput must be added here
# and the version bumped (a test compares the two).
DELTA_FIELDS = ("rid", "token_ids", "text", "logprobs", "top_logprobs", "finished",
                "finish_reason", "finish_kind", "matched_stop", "finished_len", "finish_step",
                "spec_verify_ct", "spec_accepted_tokens", "spec_acceptance_histogram",
                "spec_draft_tokens", "error", "cached_tokens")
_KEYS = frozenset({"v", "m", "d"})
MAX_TEXT_CHARS = 1 << 24
_LIMIT = (1 << 62) - 1
_COUNTS = frozenset({"finished_len", "finish_step", "spec_verify_ct", "spec_accepted_tokens",
                     "spec_draft_tokens", "cached_tokens"})


def encode_deltas(deltas: list[RequestOutput]) -> bytes:
    return pack({"v": DELTAS_VERSION, "m": "deltas", "d": [_row(d) for d in deltas]})


def decode_deltas(payload: Any) -> list[RequestOutput]:
    msg = unpack(payload)
    check_header(msg, "deltas", DELTAS_VERSION, _KEYS)
    rows = msg["d"]
    if type(rows) is not list or len(rows) > MAX_BATCH:
        raise ProtocolError(f"deltas.d must be a list of at most {MAX_BATCH} deltas")
    return [_delta(row, f"deltas.d[{i}]") for i, row in enumerate(rows)]


def _row(d: RequestOutput) -> list[Any]:
    top = None
    if d.top_logprobs is not None:
        pairs = [p for per_token in d.top_logprobs for p in per_token]
        top = [to_bin([len(t) for t in d.top_logprobs], I32, "top_logprobs"),
               to_bin([int(i) for i, _ in pairs], I32, "top_logprobs"),
               to_bin([float(x) for _, x in pairs], F64, "top_logprobs")]
    return [d.rid, to_bin(d.token_ids, I32, "token_ids"), d.text,
            None if d.logprobs is None else to_bin(d.logprobs, F64, "logprobs"), top,
            d.finished, d.finish_reason, d.finish_kind, d.matched_stop, d.finished_len,
            d.finish_step, d.spec_verify_ct, d.spec_accepted_tokens,
            to_bin(d.spec_acceptance_histogram, I32, "spec_acceptance_histogram"),
            d.spec_draft_tokens, d.error, d.cached_tokens]


def _delta(row: Any, where: str) -> RequestOutput:
    if type(row) is not list or len(row) != len(DELTA_FIELDS):
        raise ProtocolError(f"{where} must be an array of {len(DELTA_FIELDS)} fields")
    raw = dict(zip(DELTA_FIELDS, row))
    out: dict[str, Any] = {"rid": want_rids([raw["rid"]], f"{where}.rid")[0]}
    out["token_ids"] = int_list(raw["token_ids"], None, f"{where}.token_ids")
    out["text"] = want_str(raw["text"], f"{where}.text", MAX_TEXT_CHARS)
    n = len(out["token_ids"])
    out["logprobs"] = (None if raw["logprobs"] is None
                       else _floats(raw["logprobs"], n, f"{where}.logprobs"))
    out["top_logprobs"] = _top(raw["top_logprobs"], n, f"{where}.top_logprobs")
    out["finished"] = want_bool(raw["finished"], f"{where}.finished")
    for name in ("finish_reason", "finish_kind", "error"):
        value = raw[name]
        out[name] = None if value is None else want_str(value, f"{where}.{name}", 4096)
    stop = raw["matched_stop"]
    if stop is not None and type(stop) is not str:
        stop = want_int(stop, f"{where}.matched_stop", -_LIMIT, _LIMIT)
    out["matched_stop"] = stop
    for name in _COUNTS:
        value = raw[name]
        optional = name in ("finished_len", "finish_step", "cached_tokens")
        out[name] = (None if value is None and optional
                     else want_int(value, f"{where}.{name}", 0, _LIMIT))
    out["spec_acceptance_histogram"] = int_list(raw["spec_acceptance_histogram"], None,
                                                f"{where}.spec_acceptance_histogram")
    return RequestOutput(**out)


def _floats(raw: Any, count: int, name: str) -> list[float]:
    values = from_bin(raw, F64, count, name).tolist()
    if any(math.isnan(x) for x in values):
        raise ProtocolError(f"{name}: NaN")
    return values


def _top(raw: Any, n: int, name: str) -> list[list[tuple[int, float]]] | None:
    if raw is None:
        return None
    if type(raw) is not list or len(raw) != 3:
        raise ProtocolError(f"{name} must be nil or [counts, ids, logprobs]")
    counts = int_list(raw[0], n, f"{name}.counts")
    total = sum(counts)
    ids = int_list(raw[1], total, f"{name}.ids")
    lps = _floats(raw[2], total, f"{name}.logprobs")
    out, a = [], 0
    for c in counts:
        out.append(list(zip(ids[a:a + c], lps[a:a + c])))
        a += c
    return out
