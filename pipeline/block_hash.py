"""The chained key of a KV block: one definition for the prefix cache and the router.

A block of `block_size` token ids gets the key blake2b-128(parent key + the ids as int64 bytes),
the parent being the previous block's key (b"" for the first), so a key names the whole prefix up
to and including its block. The engine's prefix cache (pipeline/models/block_manager.py) keys its
full blocks so, and the prefix-affinity router (pipeline/routing/) keys a prompt so: a router key
equals the key under which a replica's cache holds that prefix (a test checks the two agree).

Pure Python, no torch: the router's process imports it. A key is stable across processes and
runs (unlike Python's `hash`, salted per process for str and bytes).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key (b"" for the first) and its tokens."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=KEY_BYTES).digest()


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained keys of the whole blocks of `tokens` (a partial last block has none):
    `keys[i] == chain_key(keys[i - 1], tokens[i * block_size:(i + 1) * block_size])`."""
    if block_size < 1:
        raise ValueError("block_size: must be an integer >= 1")
    # The ids are packed once, not per block; each key is then one hash call (~1 us).
    data = array("q", tokens).tobytes()
    step = block_size * 8  # bytes of one block's int64 ids
    keys: list[bytes] = []
    key = b""
    blake2b = hashlib.blake2b
    for start in range(0, len(tokens) // block_size * step, step):
        key = blake2b(key + data[start:start + step], digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys
