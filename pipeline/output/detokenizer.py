"""Batch decoding over a tokenizer, and what the text rules (`pipeline.output.text`) need to
know of it: special ids, byte-fallback tokens, whether decoding needs context."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, decoders


class Detokenizer:
    """Over a Hugging Face tokenizer (fast or slow) or a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any, context_free: bool | None = None) -> None:
        self.tokenizer = tokenizer
        backend = _backend(tokenizer)
        self._backend = backend
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # The Rust decode_batch, unless the tokenizer post-processes text (clean-up).
        self._native = backend is not None and (not cleanup or backend is tokenizer)
        self.special_ids = _special_ids(tokenizer, backend)
        if context_free is None:
            context_free = _is_byte_level(backend)
        self.context_free = context_free
        self.byte_tokens = _byte_fallback_ids(backend)

    def trailing_byte_run(self, seq: Sequence[int]) -> int:
        byte_tokens = self.byte_tokens
        n = 0
        for t in reversed(seq):
            if t not in byte_tokens:
                break
            n += 1
        return n

    def decode_batch(self, seqs: list[list[int]], skip: list[bool]) -> list[str]:
        """One call per distinct `skip_special_tokens` value."""
        if not seqs:
            return []
        first = skip[0]
        if all(s == first for s in skip):
            return self._decode_batch(seqs, first)
        out: list[str] = [""] * len(seqs)
        for flag in (False, True):
            idx = [i for i, s in enumerate(skip) if s == flag]
            for i, text in zip(idx, self._decode_batch([seqs[i] for i in idx], flag)):
                out[i] = text
        return out

    def decode(self, ids: list[int], skip: bool) -> str:
        return self._decode_batch([ids], skip)[0]

    def _decode_batch(self, seqs: list[list[int]], skip: bool) -> list[str]:
        if self._native:
            return self._backend.decode_batch(seqs, skip_special_tokens=skip)
        return self.tokenizer.batch_decode(seqs, skip_special_tokens=skip)


def _backend(tokenizer: Any) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _special_ids(tokenizer: Any, backend: Any) -> frozenset[int]:
    ids: set[int] = set()
    if backend is not None:
        ids.update(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
    return frozenset(ids)


def _is_byte_level(backend: Any) -> bool:
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_fallback_ids(backend: Any) -> frozenset[int]:
    if backend is None or backend.decoder is None:
        return frozenset()
    if '"ByteFallback"' not in json.dumps(json.loads(backend.decoder.__getstate__())):
        return frozenset()
    return frozenset(i for piece, i in backend.get_vocab().items() if _BYTE_PIECE.fullmatch(piece))
