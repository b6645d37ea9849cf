"""The engine <-> stage messages (pipeline.protocol.messages) as versioned msgpack: each one's
table below is its wire form (a map with `v`, `m`, then its fields in order; int columns int32
`bin`, float columns float64 `bin`, draft probabilities float32), so a plain `msgpack.unpackb`
reads every message into dicts, lists, strings, numbers and bytes. A field added to a message is
one line in its table, and a bump of its version (unknown or missing keys are errors)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.params import GRAMMAR_KINDS, Grammar, SamplingParams
from pipeline.protocol import wire
from pipeline.protocol.hidden import HIDDEN_FIELD, MAX_HIDDEN_BYTES
from pipeline.protocol.messages import NewRequest, Proposal, RankReport, StepOutcome, StepPlan
from pipeline.protocol.wire import (
    F32,
    F64,
    I32,
    MAX_BATCH,
    MAX_DRAFTED,
    RID,
    RIDS,
    TRACEPARENT,
    U8,
    Codec,
    Field,
    Kind,
    ProtocolError,
    check_keys,
    float_list,
    floats,
    from_bin,
    int_list,
    integer,
    ints,
    number,
    per,
    ragged,
    split,
    text,
    to_bin,
    want_float,
    want_int,
    want_rids,
    want_str,
)

NEW_REQUEST_VERSION = 1
PLAN_VERSION = 3  # 2: hid (HiddenStates, optional); 3: last -1 (the verifier's own last sample)
PROPOSAL_VERSION = 1
OUTCOME_VERSION = 3  # 2: kvd (rank 0's KV digest); 3: hid (HiddenStates, optional)
RANK_REPORT_VERSION = 1
MAX_DIGEST_BYTES = 64
MAX_PROPOSAL_BYTES = (1 << 31) - 1  # draft probabilities: B * k * vocab float32
MAX_GRAMMAR_CHARS = 16 << 20  # a compiled grammar's text
MAX_TENANT_CHARS = 64  # a tenant is a 32-hex-digit hash (pipeline.frontend.tenant)
MAX_STEP = 1 << 62
# The SamplingParams fields on the wire, in order: adding a field to SamplingParams changes the
# wire, so it must be added here and NEW_REQUEST_VERSION bumped (a test compares the two).
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "ignore_eos",
                   "include_stop_str_in_output", "skip_special_tokens", "logprobs", "temperature",
                   "top_p", "top_k", "seed", "min_new_tokens", "grammar")
_PARAM_KEYS = frozenset(SAMPLING_FIELDS)
_GRAMMAR_KEYS = frozenset({"kind", "compiled"})
pack, unpack = wire.pack, wire.unpack  # (as before: a test reads raw maps with these)


# --- kinds of these messages' fields -------------------------------------------------------------
def _dump_params(p: SamplingParams, attr: str) -> dict[str, Any]:
    out = {name: getattr(p, name) for name in SAMPLING_FIELDS}
    g = p.grammar
    if g is not None:
        if not (isinstance(getattr(g, "kind", None), str)
                and isinstance(getattr(g, "compiled", None), str)):
            raise ProtocolError("params.grammar: only a compiled Grammar can cross a process "
                                f"boundary, not {type(g).__name__}")
        out["grammar"] = {"kind": g.kind, "compiled": g.compiled}
    return out


def _load_params(raw: Any, where: str, got: dict[str, Any]) -> SamplingParams:
    check_keys(raw, _PARAM_KEYS, where)
    for name in ("stop", "stop_token_ids"):
        if type(raw[name]) is not list:
            raise ProtocolError(f"{where}.{name} must be a list")
    fields = dict(raw)
    fields["grammar"] = _grammar(raw["grammar"], f"{where}.grammar")
    try:  # SamplingParams checks every value (ValueError naming the field)
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{where}: {e}") from None


def _grammar(raw: Any, where: str) -> Any:
    if raw is None:
        return None
    check_keys(raw, _GRAMMAR_KEYS, where)
    if raw["kind"] not in GRAMMAR_KINDS:
        raise ProtocolError(f"{where}.kind: unknown kind {raw['kind']!r}")
    return Grammar(raw["kind"], want_str(raw["compiled"], f"{where}.compiled", MAX_GRAMMAR_CHARS))


def _load_output_count(raw: Any, name: str, got: dict[str, Any]) -> int:
    """A resumed (preempted) request's output so far is the end of its prefill."""
    return want_int(raw, name, 0, max(0, len(got["prompt_ids"]) - 1))


def _load_token_map(raw: Any, where: str, got: dict[str, Any]) -> dict[str, list[int]]:
    if type(raw) is not dict:
        raise ProtocolError(f"{where} must be a map")
    want_rids(list(raw), where)
    return {rid: int_list(t, None, f"{where}[{rid!r}]") for rid, t in raw.items()}


TOKEN_MAP = Kind(lambda v, attr: {rid: to_bin(t, I32, f"{attr}[{rid!r}]") for rid, t in v.items()},
                 _load_token_map)


def _load_digest(raw: Any, name: str, got: dict[str, Any]) -> bytes:
    if type(raw) is not bytes or len(raw) > MAX_DIGEST_BYTES:
        raise ProtocolError(f"{name} must be a bin of at most {MAX_DIGEST_BYTES} bytes")
    return raw


DIGEST = Kind(lambda v, attr: bytes(v), _load_digest)


def _nested(codec: Codec) -> Kind:
    """A list of `codec`'s messages, each a map without a header."""
    def load(raw: Any, name: str, got: dict[str, Any]) -> list[Any]:
        if type(raw) is not list or len(raw) > MAX_BATCH:
            raise ProtocolError(f"{name} must be a list of at most {MAX_BATCH} requests")
        return [codec.load_body(item, name) for item in raw]

    return Kind(lambda v, attr: [codec.body(item) for item in v], load)


def _load_expected(raw: Any, name: str, got: dict[str, Any]) -> list[float | None] | None:
    if raw is None:
        return None
    if type(raw) is not list or len(raw) != len(got["rids"]):
        raise ProtocolError(f"{name} must be nil or one entry per request")
    return [None if e is None else want_float(e, name, 0.0) for e in raw]


EXPECTED = Kind(lambda v, attr: None if v is None else [None if e is None else float(e)
                                                        for e in v], _load_expected)


def _numpy(q: Any) -> np.ndarray:
    if hasattr(q, "detach"):  # a torch tensor (the proposer keeps q on the CPU already)
        q = q.detach().float().cpu().numpy()
    return np.asarray(q)


def _dump_probs(probs: list[Any] | None, attr: str) -> tuple[Any, int, Any]:
    """(pm: a u8 flag per request, pv: the vocabulary, pq: every q's rows as one f32 bin)."""
    if probs is None:
        return None, 0, None
    rows = [_numpy(q).reshape(-1) for q in probs if q is not None]
    vocab = next((_numpy(q).shape[-1] for q in probs if q is not None), 0)
    flags = to_bin([int(q is not None) for q in probs], U8, "probs flags")
    return flags, vocab, np.concatenate(rows).astype(F32).tobytes() if rows else b""


def _load_probs(raw: tuple[Any, Any, Any], names: tuple[str, ...], got: dict[str, Any]
                ) -> list[Any] | None:
    pm, pv, pq = raw
    if pm is None and pq is None:
        if pv != 0:
            raise ProtocolError(f"{names[1]} must be 0 without probabilities")
        return None
    counts = list(map(len, got["tokens"]))
    flags = from_bin(pm, U8, len(counts), names[0]).tolist()
    if any(f > 1 for f in flags):
        raise ProtocolError(f"{names[0]}: flags must be 0 or 1")
    vocab = want_int(pv, names[1], 0)
    n_q = sum(n for n, f in zip(counts, flags) if f)
    q = from_bin(pq, F32, n_q * vocab, names[2])
    if not bool(np.isfinite(q).all()):
        raise ProtocolError(f"{names[2]}: probabilities must be finite")
    q = q.reshape(n_q, vocab).copy()  # writable: the verifier hands rows to torch
    probs, a = [], 0
    for n, f in zip(counts, flags):
        probs.append(q[a : a + n] if f else None)
        a += n if f else 0
    return probs


def _load_confidence(raw: Any, name: str, got: dict[str, Any]) -> list[list[float]] | None:
    if raw is None:
        return None
    counts = list(map(len, got["tokens"]))
    return split(float_list(raw, sum(counts), name), counts)


CONFIDENCE = Kind(lambda v, attr: None if v is None else to_bin([x for c in v for x in c],
                                                                 F64, "confidence"),
                  _load_confidence)


def _check_plan(plan: StepPlan, where: str) -> None:
    for rid, s, e in zip(plan.prefills, plan.prefill_starts, plan.prefill_ends):
        if s >= e:
            raise ProtocolError(f"{where}: prefill chunk of {rid!r} is empty or reversed "
                                f"([{s}, {e}))")
    rids = plan.rids
    if len(set(rids)) != len(rids):
        raise ProtocolError(f"{where}: a request appears twice among new, pre and dec")


def _before_proposal(p: Proposal) -> None:
    if p.probs is None and p.confidence is None:
        return
    counts = list(map(len, p.tokens))
    if p.probs is not None:
        if len(p.probs) != len(counts):
            raise ProtocolError("proposal.probs must have one entry per request")
        vocab = next((_numpy(q).shape[-1] for q in p.probs if q is not None), 0)
        for i, (q, n) in enumerate(zip(p.probs, counts)):
            if q is not None and _numpy(q).shape != (n, vocab):
                raise ProtocolError(f"proposal.probs[{i}]: shape {_numpy(q).shape} != "
                                    f"({n}, {vocab})")
    if p.confidence is not None and [len(c) for c in p.confidence] != counts:
        raise ProtocolError("proposal.confidence must align with tokens")


def _before_outcome(o: StepOutcome) -> None:
    if not len(o.tokens) == len(o.drafted) == len(o.rids):
        raise ProtocolError("outcome: rids, tokens and drafted must have the same length")


def _check_outcome(o: StepOutcome, where: str) -> None:
    if len(set(o.rids)) != len(o.rids):
        raise ProtocolError(f"{where}: duplicate request ids")


def _within_drafts(lengths: list[int], got: dict[str, Any]) -> None:
    drafted = got["drafted"]
    bad = next((i for i, (n, d) in enumerate(zip(lengths, drafted)) if n > d + 1), None)
    if bad is not None:
        raise ProtocolError(f"outcome: request {got['rids'][bad]!r} has {lengths[bad]} tokens "
                            f"for {drafted[bad]} drafted (at most drafted + 1)")


# --- the messages: dataclass field, wire key, kind ---------------------------------------------------
NEW_REQUEST = Codec(NewRequest, {"v": NEW_REQUEST_VERSION, "m": "new"}, [
    Field("rid", "rid", RID),
    Field("prompt_ids", "prompt", ints()),
    Field("params", "params", Kind(_dump_params, _load_params)),
    Field("tenant", "tenant", text(MAX_TENANT_CHARS)),
    Field("num_output", "nout", Kind(None, _load_output_count)),
    Field("chunk", "chunk", integer(1, optional=True)),  # a chunked prefill's first chunk
])
PLAN = Codec(StepPlan, {"v": PLAN_VERSION, "m": "plan"}, [
    Field("step", "step", integer(0, MAX_STEP)),
    Field("release", "rel", RIDS),
    Field("new", "new", _nested(NEW_REQUEST)),
    Field("prefills", "pre", RIDS),
    Field("prefill_starts", "pst", ints(per("prefills"))),
    Field("prefill_ends", "pend", ints(per("prefills"), 1)),
    Field("decode", "dec", RIDS),
    Field("last_tokens", "last", ints(per("decode"), -1)),
    Field("kv_lens", "kv", ints(per("decode"))),
    Field("num_outputs", "nout", ints(per("decode"))),
    Field("ks", "ks", ints(per("decode"), 0, MAX_DRAFTED)),
    Field("caps", "caps", ints(per("decode", or_none=True), 0, MAX_DRAFTED)),
    Field("min_gains", "gain", floats(per("decode", or_none=True), upper_inf=True)),
    Field("commits", "com", TOKEN_MAP),
    Field("finals", "fin", TOKEN_MAP),
    Field("traceparent", "tp", TRACEPARENT),
    Field("hidden", "hid", HIDDEN_FIELD, omit_none=True),
], check=_check_plan, max_bytes=MAX_HIDDEN_BYTES)
PROPOSAL = Codec(Proposal, {"v": PROPOSAL_VERSION, "m": "proposal"}, [
    Field("tokens", ("n", "tok"), ragged(None, 0, MAX_DRAFTED)),
    Field("probs", ("pm", "pv", "pq"), Kind(_dump_probs, _load_probs)),
    Field("confidence", "cf", CONFIDENCE),
    Field("seconds", "s", Kind(lambda v, attr: float(v), number(0.0).load)),
], before=_before_proposal, max_bytes=MAX_PROPOSAL_BYTES)
OUTCOME = Codec(StepOutcome, {"v": OUTCOME_VERSION, "m": "outcome"}, [
    Field("step", "step", integer(0, MAX_STEP)),
    Field("rids", "rids", RIDS),
    Field("tokens", ("len", "tok"), ragged(per("rids"), 1, MAX_DRAFTED + 1, _within_drafts)),
    Field("drafted", "draft", ints(per("rids"), 0, MAX_DRAFTED)),
    Field("expected", "exp", EXPECTED),
    Field("decode_s", "ds", number(0.0, optional=True)),
    Field("cached", "cached", ints()),
    Field("kv_digest", "kvd", DIGEST),
    Field("hidden", "hid", HIDDEN_FIELD, omit_none=True),
], before=_before_outcome, check=_check_outcome, first=("step", "rids", "drafted"),
    max_bytes=MAX_HIDDEN_BYTES)
RANK_REPORT = Codec(RankReport, {"v": RANK_REPORT_VERSION, "m": "rank"}, [
    Field("step", "step", integer(0, MAX_STEP)),
    Field("rank", "rank", integer(1, 1 << 16)),
    Field("kv_digest", "kvd", DIGEST),
])
encode_new_request, decode_new_request = NEW_REQUEST.encode, NEW_REQUEST.decode
encode_plan, decode_plan = PLAN.encode, PLAN.decode
encode_proposal, decode_proposal = PROPOSAL.encode, PROPOSAL.decode
encode_outcome, decode_outcome = OUTCOME.encode, OUTCOME.decode
encode_rank_report, decode_rank_report = RANK_REPORT.encode, RANK_REPORT.decode
