"""The chained key of a KV block, shared by the prefix cache and the router: blake2b-128 of the
parent block's key (b"" for the first) and the block's int64 ids, so a key names its whole
prefix. Pure Python (the router imports it) and stable across processes, unlike `hash`."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=KEY_BYTES).digest()


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One key per whole block (a partial last block has none)."""
    if block_size < 1:
        raise ValueError("block_size: must be an integer >= 1")
    data = array("q", tokens).tobytes()
    step = block_size * 8
    keys: list[bytes] = []
    key = b""
    blake2b = hashlib.blake2b
    for start in range(0, len(tokens) // block_size * step, step):
        key = blake2b(key + data[start:start + step], digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys
