"""What the msgpack step messages cost on the Ray path: encode + decode time per step of the plan,
the proposal and the outcome (pipeline.protocol.step_codec) at a few batch sizes, median of many
repetitions, and the bytes each message takes; then the output stage's deltas
(pipeline.output.delta_codec: a step's deltas, output actor -> engine; one delta alone is the
engine replica's relay message), ids only and with top-5 logprobs. No model, no Ray.

    python scripts/bench_step_messages.py [--batches 8 32] [--k 4] [--vocab 49152]

The sampled-draft proposal (a draft model at temperature > 0 sends q, [k, vocab] float32 per
request) is timed separately: its cost is the probabilities' bytes, not the framing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pipeline.output.delta_codec import decode_deltas, encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol import (
    NewRequest,
    Proposal,
    StepOutcome,
    StepPlan,
    decode_outcome,
    decode_plan,
    decode_proposal,
    encode_outcome,
    encode_plan,
    encode_proposal,
)
from scripts.harness import median_time, tree_state


def plan_of(b: int, k: int) -> StepPlan:
    rids = [f"req-{i:04d}-{'x' * 20}" for i in range(b)]
    return StepPlan(
        step=12345, release=[], new=[NewRequest("new-0", list(range(200)), SamplingParams())],
        decode=rids, last_tokens=[100 + i for i in range(b)], kv_lens=[300 + i for i in range(b)],
        num_outputs=[50 + i for i in range(b)], ks=[k] * b, caps=[k] * b,
        min_gains=[0.3] * b, commits={r: [1, 2, 3] for r in rids},
        traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")


def proposal_of(b: int, k: int, vocab: int = 0) -> Proposal:
    tokens = [[7] * k for _ in range(b)]
    probs = [torch.rand(k, vocab) for _ in range(b)] if vocab else None
    conf = None if vocab else [[0.9, 0.8, 0.6, 0.4][:k] + [0.3] * (k - 4) for _ in range(b)]
    return Proposal(tokens, probs, conf, 0.001)


def outcome_of(b: int, k: int) -> StepOutcome:
    rids = [f"req-{i:04d}-{'x' * 20}" for i in range(b)]
    return StepOutcome(7, rids, [[5] * (1 + i % (k + 1)) for i in range(b)], [k] * b,
                       [1.5] * b, decode_s=0.05)


def deltas_of(b: int, k: int, top: int) -> list[RequestOutput]:
    """A decode step's deltas: k + 1 tokens each with their logprobs (and `top` alternatives),
    a few characters of text, a histogram of k + 1 positions; every 8th request finishing."""
    out = []
    for i in range(b):
        n = k + 1
        done = i % 8 == 7
        out.append(RequestOutput(
            f"req-{i:04d}-{'x' * 20}", [1000 + i + j for j in range(n)], " tok" * n,
            [-0.25 * (j + 1) for j in range(n)],
            [[(2000 + a, -1.0 - a) for a in range(top)] for _ in range(n)] if top else None,
            done, "stop" if done else None, "eos" if done else None, 2 if done else None,
            40 + i if done else None, 12 if done else None, 9 + i, 30 + i,
            [3, 2, 2, 1, 1][:n], 36 + i))
    return out


def timed(fn: Callable[[object], object], arg: object, repeats: int) -> float:
    """Median microseconds of one call `fn(arg)`."""
    return median_time(lambda: fn(arg), repeats) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--delta-batches", type=int, nargs="+", default=[1, 8, 256])
    args = ap.parse_args()
    rows: list[dict] = [{"tree": tree_state()}]  # the commit measured, and whether it was dirty
    for b in args.batches:
        cases = {
            "plan": (plan_of(b, args.k), encode_plan, decode_plan),
            "proposal": (proposal_of(b, args.k), encode_proposal, decode_proposal),
            "outcome": (outcome_of(b, args.k), encode_outcome, decode_outcome),
            "proposal+q": (proposal_of(b, args.k, args.vocab), encode_proposal, decode_proposal),
        }
        total = 0.0
        for name, (msg, enc, dec) in cases.items():
            payload = enc(msg)
            reps = args.repeats if name != "proposal+q" else max(20, args.repeats // 100)
            e, d = timed(enc, msg, reps), timed(dec, payload, reps)
            if name != "proposal+q":
                total += e + d
            rows.append({"batch": b, "message": name, "bytes": len(payload),
                         "encode_us": round(e, 1), "decode_us": round(d, 1)})
        rows.append({"batch": b, "message": "step (plan+proposal+outcome)",
                     "encode+decode_us": round(total, 1)})
    for b in args.delta_batches:
        for name, top in (("deltas", 0), ("deltas+top5", 5)):
            batch = deltas_of(b, args.k, top)
            payload = encode_deltas(batch)
            assert decode_deltas(payload) == batch, "the deltas did not round-trip"
            reps = max(20, args.repeats * 8 // max(8, b))
            e, d = timed(encode_deltas, batch, reps), timed(decode_deltas, payload, reps)
            rows.append({"batch": b, "message": name, "bytes": len(payload),
                         "encode_us": round(e, 1), "decode_us": round(d, 1)})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
