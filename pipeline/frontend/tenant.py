"""Who a request belongs to, for what the engine keeps across requests (suffix drafting's shared
index): the API key the client presented, and the OpenAI `user` field when given.

Only a hash leaves the front end: the engine and its stages never hold a key. The id is stable
across front-end replicas and restarts (an unkeyed hash), so one tenant's requests meet in the
same partition wherever they arrive; it is logged nowhere.
"""

from __future__ import annotations

import hashlib

_PERSON = b"specrelay.tenant"  # domain separation: this hash is used for nothing else


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The `Authorization: Bearer` token the client sent (b"" when none). With the API key
    check on, it is the key; with it off, whatever the client chose to send."""
    auth = next((v for k, v in headers if k.lower() == b"authorization"), b"")
    return auth[7:].strip() if auth[:7].lower() == b"bearer " else b""


def tenant_id(token: bytes, user: str | None) -> str:
    """32 hex digits naming (token, user); "" for a request with neither (the anonymous
    tenant: every such request shares one partition)."""
    if not token and not user:
        return ""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(len(token).to_bytes(8, "little") + token)  # length-prefixed: no ambiguous joins
    h.update((user or "").encode("utf-8"))
    return h.hexdigest()
