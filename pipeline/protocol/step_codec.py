"""The engine <-> stage messages (pipeline.protocol.messages) as versioned msgpack.

Every message is a map with `v` (its version) and `m` (its kind); int columns are int32 `bin`,
float columns float64 `bin` (draft probabilities float32), so a plain `msgpack.unpackb` reads
every message into dicts, lists, strings, numbers and bytes. Wire layouts (B requests):

    new       rid str, prompt bin i32, params {every SamplingParams field; grammar nil or
              {kind, compiled}}, tenant str, nout int, chunk int >= 1 | nil
    plan      step int, rel [rid], new [{rid, prompt, params, ...}], pre [rid] (P of them),
              pst/pend bin i32[P] (0 <= start < end), dec [rid] (D of them),
              last/kv/nout/ks bin i32[D], caps bin i32[D or 0], gain bin f64[D or 0] (+inf:
              no draft can reach the floor),
              com/fin {rid: bin i32}, tp str|nil
    proposal  n bin i32[B] drafts per request, tok bin i32[sum n], pm nil | bin u8[B] (1: the
              request has q), pv int vocab, pq nil | bin f32[sum n of flagged * pv],
              cf nil | bin f64[sum n] confidence, s float seconds
    outcome   step int, rids [rid], len bin i32[B], tok bin i32[sum len], draft bin i32[B],
              exp nil | [float|nil] (B), ds float|nil, cached bin i32[P], kvd bin (KV digest)
    rank      step int, rank int, kvd bin (a verifier rank > 0 after a step)

Decoders check everything before building anything: ProtocolError names the first broken rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.params import GRAMMAR_KINDS, Grammar, SamplingParams
from pipeline.protocol.messages import NewRequest, Proposal, RankReport, StepOutcome, StepPlan
from pipeline.protocol.wire import (
    F32,
    F64,
    I32,
    MAX_BATCH,
    MAX_DRAFTED,
    U8,
    ProtocolError,
    check_header,
    check_keys,
    float_list,
    from_bin,
    int_list,
    pack,
    split,
    to_bin,
    unpack,
    want_float,
    want_int,
    want_rids,
    want_str,
    want_traceparent,
)

NEW_REQUEST_VERSION = 1
PLAN_VERSION = 1
PROPOSAL_VERSION = 1
OUTCOME_VERSION = 2  # 2: kvd (rank 0's KV digest)
RANK_REPORT_VERSION = 1
MAX_DIGEST_BYTES = 64
MAX_PROPOSAL_BYTES = (1 << 31) - 1  # draft probabilities: B * k * vocab float32
MAX_GRAMMAR_CHARS = 16 << 20  # a compiled grammar's text
# The SamplingParams fields on the wire, in order: adding a field to SamplingParams changes the
# wire, so it must be added here and NEW_REQUEST_VERSION bumped (a test compares the two).
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "ignore_eos",
                   "include_stop_str_in_output", "skip_special_tokens", "logprobs", "temperature",
                   "top_p", "top_k", "seed", "min_new_tokens", "grammar")
_PARAM_KEYS = frozenset(SAMPLING_FIELDS)
_GRAMMAR_KEYS = frozenset({"kind", "compiled"})
_NEW_BODY = frozenset({"rid", "prompt", "params", "tenant", "nout", "chunk"})
MAX_TENANT_CHARS = 64  # a tenant is a 32-hex-digit hash (pipeline.frontend.tenant)
_NEW_KEYS = _NEW_BODY | {"v", "m"}
_PLAN_KEYS = frozenset({"v", "m", "step", "rel", "new", "pre", "pst", "pend", "dec", "last",
                        "kv", "nout", "ks", "caps", "gain", "com", "fin", "tp"})
_PROPOSAL_KEYS = frozenset({"v", "m", "n", "tok", "pm", "pv", "pq", "cf", "s"})
_OUTCOME_KEYS = frozenset({"v", "m", "step", "rids", "len", "tok", "draft", "exp", "ds",
                           "cached", "kvd"})
_RANK_KEYS = frozenset({"v", "m", "step", "rank", "kvd"})


# --- new request ------------------------------------------------------------------------------
def encode_new_request(req: NewRequest) -> bytes:
    return pack({"v": NEW_REQUEST_VERSION, "m": "new", **_new_body(req)})


def decode_new_request(payload: Any) -> NewRequest:
    msg = unpack(payload)
    check_header(msg, "new", NEW_REQUEST_VERSION, _NEW_KEYS)
    return _new_request({key: msg[key] for key in _NEW_BODY}, "new")


def _new_body(req: NewRequest) -> dict[str, Any]:
    return {"rid": req.rid, "prompt": to_bin(req.prompt_ids, I32, "prompt_ids"),
            "params": _params_map(req.params), "tenant": req.tenant, "nout": req.num_output,
            "chunk": req.chunk}


def _new_request(body: Any, where: str) -> NewRequest:
    check_keys(body, _NEW_BODY, where)
    rid = want_rids([body["rid"]], f"{where}.rid")[0]
    prompt = int_list(body["prompt"], None, f"{where}.prompt")
    tenant = want_str(body["tenant"], f"{where}.tenant", MAX_TENANT_CHARS)
    # a resumed (preempted) request's output so far is the end of its prefill
    num_output = want_int(body["nout"], f"{where}.nout", 0, max(0, len(prompt) - 1))
    chunk = body["chunk"]  # a chunked prefill's first chunk: at least one token
    chunk = None if chunk is None else want_int(chunk, f"{where}.chunk", 1)
    return NewRequest(rid, prompt, _params(body["params"], f"{where}.params"), tenant,
                      num_output, chunk)


def _params_map(p: SamplingParams) -> dict[str, Any]:
    out = {name: getattr(p, name) for name in SAMPLING_FIELDS}
    g = p.grammar
    if g is not None:
        if not (isinstance(getattr(g, "kind", None), str)
                and isinstance(getattr(g, "compiled", None), str)):
            raise ProtocolError("params.grammar: only a compiled Grammar can cross a process "
                                f"boundary, not {type(g).__name__}")
        out["grammar"] = {"kind": g.kind, "compiled": g.compiled}
    return out


def _params(raw: Any, where: str) -> SamplingParams:
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


# --- plan --------------------------------------------------------------------------------------
def encode_plan(plan: StepPlan) -> bytes:
    return pack({
        "v": PLAN_VERSION, "m": "plan", "step": plan.step, "rel": plan.release,
        "new": [_new_body(n) for n in plan.new], "pre": plan.prefills,
        "pst": to_bin(plan.prefill_starts, I32, "prefill_starts"),
        "pend": to_bin(plan.prefill_ends, I32, "prefill_ends"), "dec": plan.decode,
        "last": to_bin(plan.last_tokens, I32, "last_tokens"),
        "kv": to_bin(plan.kv_lens, I32, "kv_lens"),
        "nout": to_bin(plan.num_outputs, I32, "num_outputs"),
        "ks": to_bin(plan.ks, I32, "ks"), "caps": to_bin(plan.caps, I32, "caps"),
        "gain": to_bin(plan.min_gains, F64, "min_gains"),
        "com": _token_map(plan.commits, "commits"), "fin": _token_map(plan.finals, "finals"),
        "tp": plan.traceparent,
    })


def decode_plan(payload: Any) -> StepPlan:
    msg = unpack(payload)
    check_header(msg, "plan", PLAN_VERSION, _PLAN_KEYS)
    if type(msg["new"]) is not list or len(msg["new"]) > MAX_BATCH:
        raise ProtocolError(f"plan.new must be a list of at most {MAX_BATCH} requests")
    new = [_new_request(n, "plan.new") for n in msg["new"]]
    prefills = want_rids(msg["pre"], "plan.pre")
    starts = int_list(msg["pst"], len(prefills), "plan.pst")
    ends = int_list(msg["pend"], len(prefills), "plan.pend", 1)
    bad = next((i for i, (s, e) in enumerate(zip(starts, ends)) if s >= e), None)
    if bad is not None:
        raise ProtocolError(f"plan: prefill chunk of {prefills[bad]!r} is empty or reversed "
                            f"([{starts[bad]}, {ends[bad]}))")
    decode = want_rids(msg["dec"], "plan.dec")
    d = len(decode)
    if len({n.rid for n in new} | set(prefills) | set(decode)) != len(new) + len(prefills) + d:
        raise ProtocolError("plan: a request appears twice among new, pre and dec")
    return StepPlan(
        step=want_int(msg["step"], "plan.step", 0, 1 << 62),
        release=want_rids(msg["rel"], "plan.rel"),
        new=new,
        prefills=prefills,
        prefill_starts=starts,
        prefill_ends=ends,
        decode=decode,
        last_tokens=int_list(msg["last"], d, "plan.last"),
        kv_lens=int_list(msg["kv"], d, "plan.kv"),
        num_outputs=int_list(msg["nout"], d, "plan.nout"),
        ks=int_list(msg["ks"], d, "plan.ks", 0, MAX_DRAFTED),
        caps=int_list(msg["caps"], _count(msg["caps"], d), "plan.caps", 0, MAX_DRAFTED),
        min_gains=float_list(msg["gain"], _count(msg["gain"], d), "plan.gain", upper_inf=True),
        commits=_tokens_of(msg["com"], "plan.com"),
        finals=_tokens_of(msg["fin"], "plan.fin"),
        traceparent=want_traceparent(msg["tp"], "plan.tp"),
    )


def _count(raw: Any, d: int) -> int:
    """An optional column holds one value per decode, or none (an empty bin)."""
    return 0 if raw == b"" else d


def _token_map(tokens: dict[str, list[int]], name: str) -> dict[str, bytes]:
    return {rid: to_bin(t, I32, f"{name}[{rid!r}]") for rid, t in tokens.items()}


def _tokens_of(raw: Any, where: str) -> dict[str, list[int]]:
    if type(raw) is not dict:
        raise ProtocolError(f"{where} must be a map")
    want_rids(list(raw), where)
    return {rid: int_list(t, None, f"{where}[{rid!r}]") for rid, t in raw.items()}


# --- proposal ----------------------------------------------------------------------------------
def encode_proposal(p: Proposal) -> bytes:
    b = len(p.tokens)
    counts = [len(t) for t in p.tokens]
    flags = pq = None
    vocab = 0
    if p.probs is not None:
        if len(p.probs) != b:
            raise ProtocolError("proposal.probs must have one entry per request")
        rows = []
        for i, (q, n) in enumerate(zip(p.probs, counts)):
            if q is None:
                continue
            q = _numpy(q)
            vocab = vocab or q.shape[-1]
            if q.shape != (n, vocab):
                raise ProtocolError(f"proposal.probs[{i}]: shape {q.shape} != ({n}, {vocab})")
            rows.append(q.reshape(-1))
        flags = to_bin([int(q is not None) for q in p.probs], U8, "probs flags")
        pq = np.concatenate(rows).astype(F32).tobytes() if rows else b""
    cf = None
    if p.confidence is not None:
        if [len(c) for c in p.confidence] != counts:
            raise ProtocolError("proposal.confidence must align with tokens")
        cf = to_bin([x for c in p.confidence for x in c], F64, "confidence")
    return pack({"v": PROPOSAL_VERSION, "m": "proposal", "n": to_bin(counts, I32, "tokens"),
                 "tok": to_bin([t for ts in p.tokens for t in ts], I32, "tokens"),
                 "pm": flags, "pv": vocab, "pq": pq, "cf": cf, "s": float(p.seconds)})


def decode_proposal(payload: Any) -> Proposal:
    msg = unpack(payload, MAX_PROPOSAL_BYTES)
    check_header(msg, "proposal", PROPOSAL_VERSION, _PROPOSAL_KEYS)
    counts = int_list(msg["n"], None, "proposal.n", 0, MAX_DRAFTED)
    if len(counts) > MAX_BATCH:
        raise ProtocolError(f"proposal: batch of {len(counts)} exceeds {MAX_BATCH}")
    tokens = split(int_list(msg["tok"], sum(counts), "proposal.tok"), counts)
    probs = None
    if msg["pm"] is not None or msg["pq"] is not None:
        flags = from_bin(msg["pm"], U8, len(counts), "proposal.pm").tolist()
        if any(f > 1 for f in flags):
            raise ProtocolError("proposal.pm: flags must be 0 or 1")
        vocab = want_int(msg["pv"], "proposal.pv", 0)
        n_q = sum(n for n, f in zip(counts, flags) if f)
        q = from_bin(msg["pq"], F32, n_q * vocab, "proposal.pq")
        if not bool(np.isfinite(q).all()):
            raise ProtocolError("proposal.pq: probabilities must be finite")
        q = q.reshape(n_q, vocab).copy()  # writable: the verifier hands rows to torch
        probs, a = [], 0
        for n, f in zip(counts, flags):
            probs.append(q[a : a + n] if f else None)
            a += n if f else 0
    elif msg["pv"] != 0:
        raise ProtocolError("proposal.pv must be 0 without probabilities")
    confidence = None
    if msg["cf"] is not None:
        confidence = split(float_list(msg["cf"], sum(counts), "proposal.cf"), counts)
    return Proposal(tokens=tokens, probs=probs, confidence=confidence,
                    seconds=want_float(msg["s"], "proposal.s", 0.0))


def _numpy(q: Any) -> np.ndarray:
    if hasattr(q, "detach"):  # a torch tensor (the proposer keeps q on the CPU already)
        q = q.detach().float().cpu().numpy()
    return np.asarray(q)


# --- outcome -----------------------------------------------------------------------------------
def encode_outcome(o: StepOutcome) -> bytes:
    """The outcome without its payload (the VerifyStep travels to the output stage on its own)."""
    if not len(o.tokens) == len(o.drafted) == len(o.rids):
        raise ProtocolError("outcome: rids, tokens and drafted must have the same length")
    return pack({
        "v": OUTCOME_VERSION, "m": "outcome", "step": o.step, "rids": o.rids,
        "len": to_bin([len(t) for t in o.tokens], I32, "tokens"),
        "tok": to_bin([t for ts in o.tokens for t in ts], I32, "tokens"),
        "draft": to_bin(o.drafted, I32, "drafted"),
        "exp": None if o.expected is None else [None if e is None else float(e)
                                                for e in o.expected],
        "ds": o.decode_s,
        "cached": to_bin(o.cached, I32, "cached"),
        "kvd": bytes(o.kv_digest),
    })


def decode_outcome(payload: Any) -> StepOutcome:
    msg = unpack(payload)
    check_header(msg, "outcome", OUTCOME_VERSION, _OUTCOME_KEYS)
    rids = want_rids(msg["rids"], "outcome.rids")
    if len(set(rids)) != len(rids):
        raise ProtocolError("outcome: duplicate request ids")
    b = len(rids)
    lengths = int_list(msg["len"], b, "outcome.len", 1, MAX_DRAFTED + 1)
    drafted = int_list(msg["draft"], b, "outcome.draft", 0, MAX_DRAFTED)
    bad = next((i for i in range(b) if lengths[i] > drafted[i] + 1), None)
    if bad is not None:
        raise ProtocolError(f"outcome: request {rids[bad]!r} has {lengths[bad]} tokens for "
                            f"{drafted[bad]} drafted (at most drafted + 1)")
    expected = msg["exp"]
    if expected is not None:
        if type(expected) is not list or len(expected) != b:
            raise ProtocolError("outcome.exp must be nil or one entry per request")
        expected = [None if e is None else want_float(e, "outcome.exp", 0.0) for e in expected]
    ds = msg["ds"]
    return StepOutcome(
        step=want_int(msg["step"], "outcome.step", 0, 1 << 62),
        rids=rids,
        tokens=split(int_list(msg["tok"], sum(lengths), "outcome.tok"), lengths),
        drafted=drafted,
        expected=expected,
        decode_s=None if ds is None else want_float(ds, "outcome.ds", 0.0),
        cached=int_list(msg["cached"], None, "outcome.cached"),
        kv_digest=_digest(msg["kvd"], "outcome.kvd"),
    )


def _digest(raw: Any, what: str) -> bytes:
    if type(raw) is not bytes or len(raw) > MAX_DIGEST_BYTES:
        raise ProtocolError(f"{what} must be a bin of at most {MAX_DIGEST_BYTES} bytes")
    return raw


# --- rank report -------------------------------------------------------------------------------
def encode_rank_report(r: RankReport) -> bytes:
    return pack({"v": RANK_REPORT_VERSION, "m": "rank", "step": r.step, "rank": r.rank,
                 "kvd": bytes(r.kv_digest)})


def decode_rank_report(payload: Any) -> RankReport:
    msg = unpack(payload)
    check_header(msg, "rank", RANK_REPORT_VERSION, _RANK_KEYS)
    return RankReport(step=want_int(msg["step"], "rank.step", 0, 1 << 62),
                      rank=want_int(msg["rank"], "rank.rank", 1, 1 << 16),
                      kv_digest=_digest(msg["kvd"], "rank.kvd"))
