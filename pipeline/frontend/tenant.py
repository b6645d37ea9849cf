"""Who a request belongs to, for state the engine shares across requests (suffix drafting's
index): an unkeyed hash of the API key presented and the `user` field, so the id is stable
across front ends and restarts while no key leaves the front end."""

from __future__ import annotations

import hashlib

_PERSON = b"specrelay.tenant"  # domain separation


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key when the API key check is on; whatever the client sent when it is off."""
    auth = next((v for k, v in headers if k.lower() == b"authorization"), b"")
    return auth[7:].strip() if auth[:7].lower() == b"bearer " else b""


def tenant_id(token: bytes, user: str | None) -> str:
    """"" (the anonymous tenant, one partition) for a request with neither."""
    if not token and not user:
        return ""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(len(token).to_bytes(8, "little") + token)  # length-prefixed: joins are unambiguous
    h.update((user or "").encode("utf-8"))
    return h.hexdigest()
