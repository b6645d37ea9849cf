"""Helpers for the output-path tests: a tiny byte-level BPE tokenizer, a step feeder, and a naive
reference of the finish rules (docs/contracts.md, *Finish rules (normative)*) computed from
whole-stream decodes, quadratic and obviously right."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models

from pipeline.output.processor import OutputProcessor
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol import VerifyStep, encode

EOS, STOP, PLAIN_ADDED = 0, 1, 2  # tiny tokenizer: special <eos>, special <stop>, non-special <x>


def i32(*xs: int) -> bytes:
    """A little-endian int32 wire column (pipeline.protocol), for hand-broken messages."""
    return np.array(xs, dtype="<i4").tobytes()


def f64(*xs: float) -> bytes:
    """A little-endian float64 wire column."""
    return np.array(xs, dtype="<f8").tobytes()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel decoders invert)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHARS = bytes_to_unicode()
# Multi-byte pieces on top of the 256 single bytes: words, a whole CJK char, partial UTF-8 pieces.
PIECES = [b"ab", b" the", b"stop", "世".encode(), "世".encode()[:2], "🎉".encode()[:3], b"a\xe4"]


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE over a tiny vocab: ids 0-2 added tokens, 3-258 single bytes, then PIECES."""
    vocab: dict[str, int] = {"<eos>": EOS, "<stop>": STOP, "<x>": PLAIN_ADDED}
    for b in range(256):
        vocab[BYTE_CHARS[b]] = 3 + b
    for piece in PIECES:
        vocab.setdefault("".join(BYTE_CHARS[b] for b in piece), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<stop>", special=True)])
    tok.add_tokens([AddedToken("<x>", special=False)])
    assert tok.token_to_id("<eos>") == EOS and tok.token_to_id("<x>") == PLAIN_ADDED
    return tok


SP_PIECES = ["\u2581a", "a", "\u2581b", "b", "\u2581the", "\u2581", ".", "\u2581\u4e16", "stop"]


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: `\u2581` for spaces, <0xNN> byte fallback, and a decoder that
    strips the output's leading space, so decoding needs context (not byte-level). Ids 0-2 as in
    tiny_tokenizer, 3-258 the byte tokens, then SP_PIECES."""
    vocab: dict[str, int] = {"<eos>": EOS, "<stop>": STOP, "<x>": PLAIN_ADDED}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = 3 + b
    for piece in SP_PIECES:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<stop>", special=True)])
    tok.add_tokens([AddedToken("<x>", special=False)])
    return tok


def byte_id(b: int) -> int:
    return 3 + b


def piece_id(tok: Tokenizer, piece: bytes) -> int:
    return tok.token_to_id("".join(BYTE_CHARS[b] for b in piece))


def text_ids(tok: Tokenizer, text: str) -> list[int]:
    return [byte_id(b) for b in text.encode()]


def token_logprob(pos: int, tid: int) -> float:
    return -0.001 * pos - 1e-6 * tid


def token_top(pos: int, n: int) -> list[tuple[int, float]]:
    return [(1000 + pos * 7 + j, -0.5 * j - 0.001 * pos) for j in range(n)]


def make_step(
    step: int,
    windows: dict[str, tuple[int, list[int]]],
    top_n: int = 5,
    extra_drafts: int = 0,
) -> VerifyStep:
    """A VerifyStep for `{rid: (start position, window)}` with position-derived logprobs."""
    rids = list(windows)
    token_ids = [windows[r][1] for r in rids]
    lps = [[token_logprob(p0 + k, t) for k, t in enumerate(w)] for p0, w in windows.values()]
    tops = [[token_top(p0 + k, top_n) for k in range(len(w))] for p0, w in windows.values()]
    return VerifyStep(
        step=step,
        rids=rids,
        token_ids=token_ids,
        drafted=[len(w) - 1 + extra_drafts for w in token_ids],
        logprobs=lps,
        top_logprobs=tops,
    )


@dataclass
class Collected:
    """A request's deltas folded together."""

    outs: list[RequestOutput] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [t for o in self.outs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outs)

    @property
    def logprobs(self) -> list[float] | None:
        if self.outs[0].logprobs is None:
            return None
        return [x for o in self.outs for x in o.logprobs]

    @property
    def top(self):
        if self.outs[0].top_logprobs is None:
            return None
        return [x for o in self.outs for x in o.top_logprobs]

    @property
    def last(self) -> RequestOutput:
        return self.outs[-1]

    def final(self) -> tuple:
        last = self.last
        return (
            self.ids,
            self.text,
            self.logprobs,
            self.top,
            last.finish_reason,
            last.matched_stop,
            last.finished_len,
        )


def feed(
    proc: OutputProcessor, rid: str, stream: list[int], cuts: list[int], step0: int = 0
) -> Collected:
    """Feed `stream` to `proc` in windows of the sizes in `cuts` (cycled) until it finishes."""
    got = Collected()
    pos, k, step = 0, 0, step0
    while pos < len(stream):
        size = max(1, cuts[k % len(cuts)]) if cuts else 1
        window = stream[pos : pos + size]
        outs = proc.process(encode(make_step(step, {rid: (pos, window)})))
        got.outs.extend(outs)
        pos += len(window)
        k += 1
        step += 1
        if outs and outs[-1].finished:
            break
    return got


def committed(text: str) -> str:
    return text.rstrip("\ufffd")


@dataclass
class Expected:
    ids: list[int]
    text: str
    reason: str | None
    matched: int | str | None
    finished_len: int | None


def reference(
    stream: list[int],
    params: SamplingParams,
    decode,
    eos_ids: set[int],
    special_ids: set[int],
    byte_tokens: frozenset[int] = frozenset(),
) -> Expected:
    """The finish rules straight from their definition, re-decoding the whole prefix per token.

    `decode(ids, skip_special_tokens) -> str`; `byte_tokens`: a byte-fallback tokenizer's byte
    tokens, whose trailing run's text is not committed (pipeline.output.detokenizer)."""
    skip = params.skip_special_tokens
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    prev_len = 0  # len(S(p-1))
    for p, t in enumerate(stream):
        if p >= params.min_new_tokens and t in stop_ids:
            text_ids = stream[:p] if t in special_ids else stream[: p + 1]
            return Expected(stream[: p + 1], decode(text_ids, skip), "stop", t, p + 1)
        s_p = committed(decode(stream[: p + 1], skip))
        run = 0
        while run <= p and stream[p - run] in byte_tokens:
            run += 1
        if run:
            s_p = s_p[: len(decode(stream[: p + 1 - run], skip))]
        if params.stop and p >= params.min_new_tokens:
            best = None
            for s in params.stop:
                i = s_p.find(s, max(0, prev_len - len(s) + 1))
                if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
                    best = (i, i + len(s), s)
            if best is not None:
                cut = best[1] if params.include_stop_str_in_output else best[0]
                return Expected(stream[: p + 1], s_p[:cut], "stop", best[2], p + 1)
        prev_len = len(s_p)
        if p == params.max_new_tokens - 1:
            return Expected(stream[: p + 1], decode(stream[: p + 1], skip), "length", None, p + 1)
    return Expected(list(stream), decode(stream, skip), None, None, None)


def tool_calls_through_output_stage(tok: Tokenizer, parser: Any, text: str, cuts: list[int]
                                    ) -> tuple[Any, list[str]]:
    """`text` then EOS through the real OutputProcessor in windows of `cuts` tokens, each delta's
    text through the tool-call `parser`: all its deltas added up, and each delta's content."""
    from pipeline.output.tool_calls import ToolDelta

    proc = OutputProcessor(tok, [EOS])
    proc.add_request("r", [1, 2], SamplingParams(max_new_tokens=4096))
    got = feed(proc, "r", text_ids(tok, text) + [EOS], cuts)
    assert got.last.finished and got.text == text
    total, pieces = ToolDelta(), []
    for out in got.outs:
        d = parser.feed(out.text)
        if out.finished:
            d.add(parser.finish())
        pieces.append(d.content)
        total.add(d)
    return total, pieces
