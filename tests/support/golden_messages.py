"""A fixed set of messages of every kind on the wire, built from seeded `random.Random`s, so the
bytes each encoder makes can be recorded once (tests/protocol/golden_digests.json) and compared after any
change to the codecs: the message contract (docs/contracts.md) promises the same bytes.

    PYTHONPATH=$PWD python tests/support/golden_messages.py > tests/protocol/golden_digests.json
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pipeline.engine.relay import RelayMessage, decode_relay, encode_relay
from pipeline.output.delta_codec import decode_deltas, encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.params import Grammar, SamplingParams
from pipeline.protocol import (
    NewRequest,
    Proposal,
    RankReport,
    StepColumns,
    StepOutcome,
    StepPlan,
    VerifyStep,
    decode,
    decode_columns,
    decode_new_request,
    decode_outcome,
    decode_plan,
    decode_proposal,
    decode_rank_report,
    encode,
    encode_columns,
    encode_new_request,
    encode_outcome,
    encode_plan,
    encode_proposal,
    encode_rank_report,
)

TP = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
PER_KIND = 40


def _rids(r: random.Random, n: int) -> list[str]:
    return [f"r{i}-" + "x" * r.randint(0, 12) for i in range(n)]


def _tokens(r: random.Random, lo: int, hi: int) -> list[int]:
    return [r.choice([0, 1, 7, 50_000, (1 << 31) - 1]) for _ in range(r.randint(lo, hi))]


def _params(r: random.Random) -> SamplingParams:
    n = r.randint(1, 64)
    grammar = r.choice([None, None, Grammar("regex", "[a-z]+"), Grammar("json_schema", "{}")])
    return SamplingParams(
        max_new_tokens=n, stop=r.sample(["\n", "END", "ü"], r.randint(0, 2)),
        stop_token_ids=_tokens(r, 0, 3), ignore_eos=r.random() < 0.5,
        include_stop_str_in_output=r.random() < 0.5, skip_special_tokens=r.random() < 0.5,
        logprobs=r.choice([None, 0, 5, 20]), temperature=r.choice([0.0, 0.7, 2.0]),
        top_p=r.choice([1.0, 0.9]), top_k=r.choice([-1, 0, 40]),
        seed=r.choice([None, 0, (1 << 63) - 1]), min_new_tokens=r.randint(0, n), grammar=grammar)


def new_request(r: random.Random, rid: str = "n") -> NewRequest:
    prompt = _tokens(r, 1, 9)
    return NewRequest(rid, prompt, _params(r), r.choice(["", "0123456789abcdef" * 2]),
                      r.randint(0, len(prompt) - 1), r.choice([None, 1, 3]))


def plan(r: random.Random) -> StepPlan:
    ids = _rids(r, r.randint(0, 9))
    n_new, n_pre = r.randint(0, len(ids)), r.randint(0, 2)
    pre = [f"p{i}" for i in range(n_pre)]
    starts = [r.randint(0, 100) for _ in pre]
    dec, d = ids[n_new:], len(ids) - n_new
    scored = r.random() < 0.5
    return StepPlan(
        step=r.randint(0, 1 << 40), release=_rids(r, r.randint(0, 3)),
        new=[new_request(r, rid) for rid in ids[:n_new]], prefills=pre, prefill_starts=starts,
        prefill_ends=[s + r.randint(1, 50) for s in starts], decode=dec,
        last_tokens=_tokens(r, d, d), kv_lens=[r.randint(0, 4096) for _ in dec],
        num_outputs=[r.randint(0, 999) for _ in dec], ks=[r.randint(0, 8) for _ in dec],
        caps=[r.randint(0, 8) for _ in dec] if scored else [],
        min_gains=[r.choice([0.0, 0.25, 1e-9, float("inf")]) for _ in dec] if scored else [],
        commits={rid: _tokens(r, 1, 5) for rid in dec[:3]},
        finals={rid: _tokens(r, 0, 5) for rid in _rids(r, r.randint(0, 2))},
        traceparent=r.choice([None, TP]))


def proposal(r: random.Random) -> Proposal:
    tokens = [_tokens(r, 0, 5) for _ in range(r.randint(0, 6))]
    probs = confidence = None
    if r.random() < 0.5:
        vocab = r.randint(1, 7)
        probs = [np.array([r.random() for _ in range(vocab * len(t))], np.float32)
                 .reshape(len(t), vocab) if r.random() < 0.6 else None for t in tokens]
    if r.random() < 0.5:
        confidence = [[r.random() for _ in t] for t in tokens]
    return Proposal(tokens, probs, confidence, r.choice([0.0, 0.001, 2.5]))


def outcome(r: random.Random) -> StepOutcome:
    ids = _rids(r, r.randint(0, 6))
    tokens = [_tokens(r, 1, 5) for _ in ids]
    expected = [r.choice([None, 0.0, 1.75]) for _ in ids] if r.random() < 0.5 else None
    return StepOutcome(
        r.randint(0, 1 << 40), ids, tokens, [len(t) - 1 + r.randint(0, 3) for t in tokens],
        expected, decode_s=r.choice([None, 0.0, 0.05]),
        cached=[r.randint(0, 4096) for _ in range(r.randint(0, len(ids)))],
        kv_digest=r.randbytes(r.choice([0, 16, 32])))


def rank_report(r: random.Random) -> RankReport:
    return RankReport(r.randint(0, 1 << 40), r.randint(1, 7), r.randbytes(r.choice([0, 32])))


def verify_step(r: random.Random) -> VerifyStep:
    ids = _rids(r, r.randint(0, 6))
    token_ids = [_tokens(r, 1, 5) for _ in ids]
    logprobs = [[-r.random() for _ in t] for t in token_ids] if r.random() < 0.5 else None
    top = None
    if r.random() < 0.5:
        top = []
        for t in token_ids:
            n = r.randint(0, 3)
            top.append([[(r.randint(0, 99), -r.random()) for _ in range(n)] for _ in t])
    return VerifyStep(r.randint(0, 1 << 40), ids, token_ids,
                      [len(t) - 1 + r.randint(0, 2) for t in token_ids], logprobs, top,
                      r.choice([None, TP]), r.choice([0.0, 1.7e9 + r.random()]))


def columns(r: random.Random) -> StepColumns:
    """A verify step with the optional `ch` column (prefix-cache hits), as the verifier sends."""
    step = verify_step(r)
    cols = decode_columns(encode(step))
    cols.cached = np.array([r.randint(0, 512) for _ in step.rids], np.int64)
    return cols


def deltas(r: random.Random) -> list[RequestOutput]:
    out = []
    for rid in _rids(r, r.randint(0, 5)):
        ids = _tokens(r, 0, 5)
        done = r.random() < 0.3
        out.append(RequestOutput(
            rid, ids, r.choice(["", " tok", "é\n"]),
            [-r.random() for _ in ids] if r.random() < 0.5 else None,
            [[(r.randint(0, 99), -r.random()) for _ in range(r.randint(0, 3))] for _ in ids]
            if r.random() < 0.5 else None,
            done, "stop" if done else None, r.choice([None, "eos"]) if done else None,
            r.choice([None, 2, "END"]), r.choice([None, 40]), r.choice([None, 12]),
            r.randint(0, 1 << 40), r.randint(0, 99), [r.randint(0, 9) for _ in range(r.randint(0, 5))],
            r.randint(0, 99), r.choice([None, None, "engine died"]), r.choice([None, 16])))
    return out


def relay(r: random.Random) -> RelayMessage:
    errors = [(rid, r.choice(["engine died", ""])) for rid in _rids(r, r.randint(0, 2))]
    return RelayMessage(encode_deltas(deltas(r)), errors)


def _same_columns(a: StepColumns, b: StepColumns) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray) else x == y
        for x, y in ((getattr(a, f), getattr(b, f)) for f in vars(b)))


def _same_proposal(a: Proposal, b: Proposal) -> bool:
    probs = ((p is None and q is None) or np.array_equal(p, q)
             for p, q in zip(a.probs or [], b.probs or []))
    return ((a.tokens, a.confidence, a.seconds) == (b.tokens, b.confidence, b.seconds)
            and (a.probs is None) == (b.probs is None) and all(probs))


def _eq(a: Any, b: Any) -> bool:
    return a == b


# kind: (build, encode, decode, same)
KINDS: dict[str, tuple[Callable, Callable, Callable, Callable]] = {
    "new": (new_request, encode_new_request, decode_new_request, _eq),
    "plan": (plan, encode_plan, decode_plan, _eq),
    "proposal": (proposal, encode_proposal, decode_proposal, _same_proposal),
    "outcome": (outcome, encode_outcome, decode_outcome, _eq),
    "rank": (rank_report, encode_rank_report, decode_rank_report, _eq),
    "verify": (verify_step, encode, decode, _eq),
    "columns": (columns, encode_columns, decode_columns, _same_columns),
    "deltas": (deltas, encode_deltas, decode_deltas, _eq),
    "relay": (relay, encode_relay, decode_relay, _eq),
}


def messages(kind: str) -> Iterator[tuple[int, Any]]:
    build = KINDS[kind][0]
    for seed in range(PER_KIND):
        yield seed, build(random.Random(f"{kind}-{seed}"))


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:24]


if __name__ == "__main__":
    print(json.dumps({kind: [digest(KINDS[kind][1](m)) for _, m in messages(kind)]
                      for kind in KINDS}, indent=0))
