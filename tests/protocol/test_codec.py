"""wire.Codec, the table a message's encoder and decoder are made from: every field of each
message is in its table (or named as never sent), a field is one line, and the table's order,
optional keys, nested messages and field names are what the wire shows."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pipeline.engine.relay import RELAY
from pipeline.output.delta_codec import DELTAS
from pipeline.protocol.step_codec import NEW_REQUEST, OUTCOME, PLAN, PROPOSAL, RANK_REPORT
from pipeline.protocol.verify_step import COLUMNS
from pipeline.protocol.wire import (
    RIDS,
    Codec,
    Field,
    Kind,
    ProtocolError,
    integer,
    ints,
    per,
    text,
)

# fields that never cross a process: the payload travels on its own, `undrafted` is the engine's
LOCAL = {OUTCOME: {"payload", "undrafted"}, COLUMNS: set()}


@pytest.mark.parametrize("codec", [NEW_REQUEST, PLAN, PROPOSAL, OUTCOME, RANK_REPORT, COLUMNS],
                         ids=lambda c: c.what)
def test_every_dataclass_field_is_in_its_table_once(codec):
    on_wire = [f.attr for f in codec.fields]
    assert len(set(on_wire)) == len(on_wire)
    declared = {f.name for f in dataclasses.fields(codec.cls)}
    assert set(on_wire) == declared - LOCAL.get(codec, set())


@pytest.mark.parametrize("codec", [NEW_REQUEST, PLAN, PROPOSAL, OUTCOME, RANK_REPORT, COLUMNS,
                                   DELTAS, RELAY], ids=lambda c: c.what)
def test_no_two_fields_share_a_wire_key(codec):
    keys = [k for f in codec.fields for k in ((f.key,) if type(f.key) is str else f.key)]
    assert len(set(keys)) == len(keys) and not set(keys) & set(codec.header)


@dataclasses.dataclass
class Item:
    name: str
    size: int = 0


@dataclasses.dataclass
class Box:
    ids: list[str]
    counts: list[int]
    label: str | None = None
    items: list[Item] = dataclasses.field(default_factory=list)


ITEM = Codec(Item, {"v": 1, "m": "item"}, [
    Field("name", "n", text(8)),
    Field("size", "sz", integer(0, 10)),
])


def _items(codec: Codec) -> Kind:
    return Kind(lambda v, attr: [codec.body(x) for x in v],
                lambda raw, name, got: [codec.load_body(x, name) for x in raw])


BOX = Codec(Box, {"m": "box", "v": 3}, [
    Field("ids", "ids", RIDS),
    Field("counts", "c", ints(per("ids"))),
    Field("items", "it", _items(ITEM)),
    Field("label", "lbl", omit_none=True),
])


def test_the_map_holds_the_header_then_the_fields_in_table_order():
    box = Box(["a", "b"], [1, 2], "x", [Item("i", 3)])
    msg = msgpack.unpackb(BOX.encode(box))
    assert list(msg) == ["m", "v", "ids", "c", "it", "lbl"]
    assert msg["it"] == [{"n": "i", "sz": 3}]
    assert BOX.decode(BOX.encode(box)) == box


def test_an_optional_key_is_left_off_when_none_and_read_back_as_none():
    box = Box(["a"], [1])
    assert "lbl" not in msgpack.unpackb(BOX.encode(box))
    assert BOX.decode(BOX.encode(box)) == box


def test_a_field_decoded_against_an_earlier_one_is_named_when_it_does_not_fit():
    msg = msgpack.unpackb(BOX.encode(Box(["a", "b"], [1, 2])))
    msg["ids"] = ["a"]
    with pytest.raises(ProtocolError, match=r"box\.c: expected 1 int32"):
        BOX.decode(msgpack.packb(msg))


def test_a_nested_message_names_its_fields_under_its_parent():
    msg = msgpack.unpackb(BOX.encode(Box(["a"], [1], items=[Item("i")])))
    msg["it"][0]["sz"] = 11
    with pytest.raises(ProtocolError, match=r"box\.it\.sz must be an integer in \[0, 10\]"):
        BOX.decode(msgpack.packb(msg))
    msg["it"][0] = {"n": "i"}
    with pytest.raises(ProtocolError, match=r"box\.it: missing fields \['sz'\]"):
        BOX.decode(msgpack.packb(msg))


@pytest.mark.parametrize(("change", "error"), [
    ({"v": 2}, "unsupported version 2"),
    ({"v": 3.0}, "unsupported version 3.0"),
    ({"m": "item"}, "expected a 'box' message"),
    ({"extra": 1}, "unknown fields ['extra']"),
])
def test_the_header_and_the_keys_are_checked_first(change, error):
    msg = {**msgpack.unpackb(BOX.encode(Box(["a"], [1]))), **change}
    with pytest.raises(ProtocolError) as e:
        BOX.decode(msgpack.packb(msg))
    assert error in str(e.value)


def test_optional_keys_must_come_last_in_the_table():
    with pytest.raises(ValueError, match="optional keys come last"):
        Codec(Box, {"v": 1}, [Field("label", "lbl", omit_none=True), Field("ids", "ids", RIDS)])
