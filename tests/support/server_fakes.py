"""A fake engine with the Engine actor's API, a byte tokenizer, and in-process calls to the app
(`call`, `check_openai_error`), for front-end tests.

The fake "generates" a fixed script (rotated by the seed when sampling), delivers it in
speculative-looking windows of `window` tokens, and applies the finish rules itself (stop token,
EOS, stop string, length) so that responses have known, literal contents.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipeline.errors import EngineOverloadedError
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall

EOS = 3
SCRIPT = "Hello world! This is the fake engine speaking. "


class ByteTok:
    """Token id = UTF-8 byte; no chat template (the server's plain fallback applies)."""

    eos_token_id = EOS
    chat_template = None

    def __len__(self) -> int:  # the vocabulary a grammar is compiled against
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != EOS or not skip_special_tokens).decode(
            "utf-8", errors="replace")


def fake_logprob(token: int) -> float:
    return -round((token % 7) / 10 + 0.01, 6)


@dataclass
class FakeEngine:
    num_slots: int = 4
    max_waiting: int = 0
    window: int = 3  # tokens per delta
    step_delay: float = 0.0
    hang: bool = False  # never produce a delta (for timeouts)
    healthy: bool = True
    script: str = SCRIPT
    eos_after: int | None = None  # append EOS after this many script tokens
    max_model_len: int = 128
    requests: dict[str, SamplingParams] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    groups: dict[str, str | None] = field(default_factory=dict)  # rid -> group
    tenants: dict[str, str] = field(default_factory=dict)  # rid -> tenant
    lasts: list[str] = field(default_factory=list)  # requests sent as a batch's last
    # Set: awaited before a request is queued (it may raise a refusal), and then an empty first
    # delta says it is queued, as the real engine clients do.
    admit: Callable[[EngineCall], Awaitable[None]] | None = None

    def stream_tokens(self, params: SamplingParams) -> list[int]:
        text = self.script
        if params.temperature > 0 and params.seed is not None:
            k = params.seed % len(text)
            text = text[k:] + text[:k]
        ids = list((text * 20).encode("utf-8"))
        if self.eos_after is not None:
            ids = ids[: self.eos_after] + [EOS] + ids[self.eos_after:]
        return ids

    async def generate(self, call: EngineCall) -> AsyncIterator[RequestOutput]:
        if self.admit is not None:
            await self.admit(call)
        if len(self.running) >= self.num_slots + self.max_waiting:
            raise EngineOverloadedError(f"queue full ({len(self.running)} requests)")
        rid, params = call.rid, call.params
        self.requests[rid], self.prompts[rid] = params, list(call.prompt_ids)
        self.groups[rid] = call.group
        self.tenants[rid] = call.tenant
        if call.last:
            self.lasts.append(rid)
        self.running.add(rid)
        try:
            if self.admit is not None:
                yield RequestOutput(rid)
            async for out in self._outputs(rid, params):
                yield out
        finally:
            self.running.discard(rid)

    async def _outputs(self, rid: str, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.hang:
            await asyncio.Event().wait()
        tokens, end, kind, matched, text_end = self._finish(params)
        reason = "length" if kind == "length" else "stop"
        tok = ByteTok()
        sent_text, hist = 0, [0] * (self.window)
        for start in range(0, end, self.window):
            await asyncio.sleep(self.step_delay)
            if rid in self.aborted:
                return
            chunk = tokens[start:min(start + self.window, end)]
            done = start + self.window >= end
            hist[len(chunk) - 1] += 1
            full = tok.decode(tokens[: start + len(chunk)])
            upto = text_end if done else min(len(full), text_end)
            text, sent_text = full[sent_text:upto], max(sent_text, upto)
            lps = [fake_logprob(t) for t in chunk] if params.logprobs is not None else None
            top = ([[(t, fake_logprob(t))] + [((t + i) % 256, -5.0 - i)
                                              for i in range(1, params.logprobs)]
                    for t in chunk] if params.logprobs else
                   ([[] for _ in chunk] if params.logprobs == 0 else None))
            n_verify = start // self.window + 1
            yield RequestOutput(
                rid=rid, token_ids=chunk, text=text, logprobs=lps, top_logprobs=top,
                finished=done, finish_reason=reason if done else None,
                finish_kind=kind if done else None, matched_stop=matched if done else None, finished_len=end if done else None,
                spec_verify_ct=n_verify, spec_accepted_tokens=start + len(chunk) - n_verify,
                spec_acceptance_histogram=list(hist),
                spec_draft_tokens=n_verify * (self.window - 1))
        self.finished.append(rid)

    def _finish(self, p: SamplingParams) -> tuple[list[int], int, str, Any, int]:
        """(tokens, finished_len, finish kind, matched, text length) by the normative finish
        order."""
        tokens = self.stream_tokens(p)[: p.max_new_tokens]
        tok = ByteTok()
        for i, t in enumerate(tokens):
            if i >= p.min_new_tokens and (t in p.stop_token_ids or (t == EOS and not p.ignore_eos)):
                kind = "stop_token" if t in p.stop_token_ids else "eos"
                return tokens, i + 1, kind, t, len(tok.decode(tokens[: i + 1]))
            text = tok.decode(tokens[: i + 1])
            for s in p.stop:
                at = text.find(s)
                if at >= 0:
                    keep = at + len(s) if p.include_stop_str_in_output else at
                    return tokens, i + 1, "stop_string", s, keep
        return tokens, len(tokens), "length", None, len(tok.decode(tokens))

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.running.discard(rid)

    async def stats(self) -> dict[str, Any]:
        return {"num_slots": self.num_slots, "free_slots": self.num_slots - len(self.running),
                "running": len(self.running), "waiting": 0, "max_waiting": self.max_waiting,
                "steps": 10, "dropped_steps": 2, "num_draft_tokens": 40, "num_accepted_tokens": 30,
                "healthy": self.healthy, "acceptance_histogram": [1, 2, 3, 4]}

    async def health(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "reason": "" if self.healthy else "step loop stalled"}

    async def model_info(self) -> dict[str, Any]:
        return {"name": "fake-model", "source": "fake:0", "max_model_len": self.max_model_len,
                "vocab_size": 256, "eos_token_ids": [EOS]}


# --- calling the app in-process (httpx over ASGI, no sockets)


async def call(app: Any, method: str, path: str, body: Any = None,
               headers: list[tuple[str, str]] | None = None) -> httpx.Response:
    content = None if body is None else json.dumps(body).encode()  # ensure_ascii: any str
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
        hdrs = [("content-type", "application/json"), *(headers or [])]
        return await c.request(method, path, content=content, headers=hdrs)


def check_openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] is None or isinstance(err["param"], str)
    return err
