"""HiddenStates as its own versioned msgpack message, carried as a bin by the outcome and the
plan (`hid`): rows travel as raw float32, float16 or bfloat16 bytes, decoded to a CPU tensor."""

from __future__ import annotations

from typing import Any

from pipeline.protocol.messages import HiddenStates
from pipeline.protocol.wire import (
    INT32_MAX,
    RIDS,
    Codec,
    Field,
    Kind,
    ProtocolError,
    ints,
    per,
    want_int,
)

HIDDEN_VERSION = 1
MAX_HIDDEN_BYTES = (1 << 31) - 1  # a long prefill chunk at 8B dims: 24 KiB a position
DTYPES = {"f32": 4, "f16": 2, "bf16": 2}


def _torch_dtypes() -> dict[str, Any]:
    import torch  # lazy: the protocol is imported where torch is not (the ingress)

    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _dump_rows(rows: Any, attr: str) -> tuple[str, int, bytes]:
    names = {v: k for k, v in _torch_dtypes().items()}
    if rows.dim() != 2 or rows.dtype not in names:
        raise ProtocolError(f"hidden.rows: a 2-D float32/float16/bfloat16 tensor, not "
                            f"{tuple(rows.shape)} {rows.dtype}")
    import torch

    raw = rows.detach().cpu().contiguous()
    if raw.dtype != torch.float32:  # numpy has no bfloat16: the same bytes as int16
        raw = raw.view(torch.int16)
    return names[rows.dtype], int(rows.shape[1]), raw.numpy().tobytes()


def _load_rows(raw: tuple[Any, Any, Any], names: tuple[str, ...], got: dict[str, Any]) -> Any:
    import torch

    dt, width, data = raw
    if dt not in DTYPES:
        raise ProtocolError(f"{names[0]}: unknown dtype {dt!r} (one of {sorted(DTYPES)})")
    width = want_int(width, names[1], 1, INT32_MAX)
    n = sum(got["counts"])
    if type(data) is not bytes or len(data) != n * width * DTYPES[dt]:
        raise ProtocolError(f"{names[2]}: expected {n} x {width} {dt} values")
    # not checked finite (it would double the decode): a bad state only makes bad drafts,
    # which the target rejects
    rows = torch.frombuffer(bytearray(data), dtype=_torch_dtypes()[dt]) if data else \
        torch.zeros(0, dtype=_torch_dtypes()[dt])
    return rows.view(n, width)


def _before(h: HiddenStates) -> None:
    if not len(h.rids) == len(h.starts) == len(h.counts):
        raise ProtocolError("hidden: rids, starts and counts must have the same length")
    if h.rows.shape[0] != sum(h.counts):
        raise ProtocolError(f"hidden: {h.rows.shape[0]} rows for {sum(h.counts)} positions")


def _check(h: HiddenStates, where: str) -> None:
    if len(set(h.rids)) != len(h.rids):
        raise ProtocolError(f"{where}: duplicate request ids")


HIDDEN = Codec(HiddenStates, {"v": HIDDEN_VERSION, "m": "hidden"}, [
    Field("rids", "rids", RIDS),
    Field("starts", "start", ints(per("rids"))),
    Field("counts", "n", ints(per("rids"), 1)),
    Field("rows", ("dt", "w", "x"), Kind(_dump_rows, _load_rows)),
], before=_before, check=_check, max_bytes=MAX_HIDDEN_BYTES)
encode_hidden, decode_hidden = HIDDEN.encode, HIDDEN.decode
# a field of the outcome and the plan: the message's bytes, left off when there are none
HIDDEN_FIELD = Kind(lambda v, attr: None if v is None else encode_hidden(v),
                    lambda raw, name, got: decode_hidden(raw))
