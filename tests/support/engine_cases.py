"""Requests for the engine tests (in-process and on Ray): prompts of the tiny model, a mixed
batch of stop rules, and what the output rules keep of a greedy reference stream."""

from __future__ import annotations

from pipeline.models.runners import tiny_tokenizer
from pipeline.params import SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7],
    [100, 101],
    [3] * 20,
    [50, 60, 70, 80, 90, 50, 60],
    [200, 201, 202, 203],
    [17],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 30, 31, 32],
    [77, 78, 77, 78, 77],
]
LOSSY_PROMPT = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 30, 31, 32]  # n-gram drafts get rejected
TOK = tiny_tokenizer()


def ids(deltas: list) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def mixed_requests(n: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Mixed lengths and stop conditions (EOS on, stop strings and ids, logprobs)."""
    reqs = []
    for i in range(n):
        p = PROMPTS[i % len(PROMPTS)]
        params = SamplingParams(max_new_tokens=25 + 5 * i, logprobs=i % 3 or None,
                                stop=[chr(p[0])] if i % 4 == 1 else [],
                                stop_token_ids=[p[-1]] if i % 4 == 2 else [])
        reqs.append((f"r{i}", p, params))
    return reqs


def expected_cut(ref: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """What the output rules keep of a greedy token stream (EOS id 2 on)."""
    stops = set(params.stop_token_ids) | {2}
    end = params.max_new_tokens
    for pos, t in enumerate(ref[:end]):
        if t in stops and pos >= params.min_new_tokens:
            end = pos + 1
            break
    text = TOK.decode(ref[:end], skip_special_tokens=True)
    for s in params.stop:
        at = text.find(s)
        if at >= 0:
            # the token holding the stop string's last character ends the request
            chars = at + len(s)
            end = next(n for n in range(1, end + 1)
                       if len(TOK.decode(ref[:n], skip_special_tokens=True)) >= chars)
            text = text[:at]
    return ref[:end], text
