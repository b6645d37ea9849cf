"""Hostile request bodies and what the front end must answer to each (a 4xx, never a 5xx):
shared by the in-process security tests and the reliability tests on the real service."""

from __future__ import annotations

import json

import httpx

# (name, path, raw JSON body or dict, extra headers, accepted statuses). Raw strings carry what
# json.dumps will not write: NaN/Infinity tokens and lone-surrogate escapes.

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("max_tokens 0", C, {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens -1", C, {"prompt": "hi", "max_tokens": -1}, 400),
    ("max_tokens 2^31", C, {"prompt": "hi", "max_tokens": 2**31}, 400),
    ("max_tokens 2^70", C, {"prompt": "hi", "max_tokens": 2**70}, 400),
    ("max_tokens beyond the context", C, {"prompt": "hi", "max_tokens": 100_000}, 400),
    ("chat max_completion_tokens 0", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400),
    ("temperature NaN", C, '{"prompt": "hi", "temperature": NaN}', 400),
    ("temperature Infinity", C, '{"prompt": "hi", "temperature": Infinity}', 400),
    ("temperature -Infinity", C, '{"prompt": "hi", "temperature": -Infinity}', 400),
    ("temperature negative", C, {"prompt": "hi", "temperature": -0.5}, 400),
    ("temperature 1e308*10", C, '{"prompt": "hi", "temperature": 1e400}', 400),
    ("top_p 0", C, {"prompt": "hi", "top_p": 0}, 400),
    ("top_p 1.5", C, {"prompt": "hi", "top_p": 1.5}, 400),
    ("top_p NaN", CHAT, '{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 400),
    ("huge n", C, {"prompt": "hi", "n": 10**9}, 400),
    ("n 0", C, {"prompt": "hi", "n": 0}, 400),
    ("huge logprobs", C, {"prompt": "hi", "logprobs": 10**9}, 400),
    ("negative logprobs", C, {"prompt": "hi", "logprobs": -1}, 400),
    ("huge top_logprobs", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 10**9},
     400),
    ("10,000 stop strings", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}, 400),
    ("a 1 MB stop string", C, {"prompt": "hi", "stop": ["x" * (1 << 20)]}, 413),
    ("a 600 KB stop string under a larger body limit", C,
     {"prompt": "hi", "stop": ["x" * 600_000]}, 400),
    ("lone surrogate in the prompt", C, '{"prompt": "a\\ud800b"}', 400),
    ("lone low surrogate in chat", CHAT,
     '{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    ("NUL in the prompt", C, {"prompt": "a\u0000b"}, 400),
    ("NUL in a chat message", CHAT, {"messages": [{"role": "user", "content": "\u0000"}]}, 400),
    ("NUL in a stop string", C, {"prompt": "hi", "stop": ["\u0000"]}, 400),
    ("token id out of the vocabulary", C, {"prompt": [1, 2, 10**12]}, 400),
    ("negative token id", C, {"prompt": [-1]}, 400),
    ("empty prompt", C, {"prompt": ""}, 400),
    ("a string where a number goes", C, {"prompt": "hi", "max_tokens": "5"}, 400),
    ("not JSON", C, "{not json", 400),
    ("a JSON array body", C, "[1, 2]", 400),
    ("deeply nested JSON", C, "[" * 100_000 + "]" * 100_000, 400),
    ("a 10 MB body", C, {"prompt": "x" * (10 << 20)}, 413),
]


def encode_body(body) -> bytes:
    return body.encode() if isinstance(body, str) else json.dumps(body).encode()


def check_error(r: httpx.Response, allowed: set[int]) -> None:
    assert r.status_code in allowed, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
