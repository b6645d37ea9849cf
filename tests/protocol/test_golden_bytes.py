"""The bytes on the wire do not change: every message of support/golden_messages.py encodes to the
digest recorded from the codecs before issue 57 (declarative codecs) and decodes back to the
message it came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.golden_messages import KINDS, digest, messages

RECORDED = json.loads((Path(__file__).parent / "golden_digests.json").read_text())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_message_encodes_to_the_recorded_bytes_and_decodes_to_itself(kind):
    _, encode, decode, same = KINDS[kind]
    got = []
    for seed, msg in messages(kind):
        payload = encode(msg)
        assert same(decode(payload), msg), f"{kind} #{seed} did not round-trip"
        got.append(digest(payload))
    assert got == RECORDED[kind]


def test_the_recording_covers_every_kind():
    assert set(RECORDED) == set(KINDS)
