"""Every message between the engine and its stages, declared in one place (`messages`, and
`verify_step` for the verifier -> output message), each versioned msgpack between processes
(`step_codec`, `verify_step`) under one set of wire rules (`wire`); and the request that enters
the engine (`engine_call`). Imports nothing above it: every stage may import the protocol, the
protocol imports no stage."""

from pipeline.protocol.engine_call import EngineCall
from pipeline.protocol.hidden import HIDDEN_VERSION, decode_hidden, encode_hidden
from pipeline.protocol.messages import (
    HiddenStates,
    NewRequest,
    Proposal,
    RankReport,
    StepOutcome,
    StepPlan,
    draft_room,
)
from pipeline.protocol.step_codec import (
    NEW_REQUEST_VERSION,
    OUTCOME_VERSION,
    PLAN_VERSION,
    PROPOSAL_VERSION,
    RANK_REPORT_VERSION,
    SAMPLING_FIELDS,
    decode_new_request,
    decode_outcome,
    decode_plan,
    decode_proposal,
    decode_rank_report,
    encode_new_request,
    encode_outcome,
    encode_plan,
    encode_proposal,
    encode_rank_report,
)
from pipeline.protocol.verify_step import (
    MAX_TOP_N,
    PROTOCOL_VERSION,
    StepColumns,
    VerifyStep,
    columns_from_step,
    decode,
    decode_columns,
    encode,
    encode_columns,
    validate_columns,
)
from pipeline.protocol.wire import (
    MAX_BATCH,
    MAX_DRAFTED,
    MAX_PAYLOAD_BYTES,
    MAX_RID_CHARS,
    ProtocolError,
)

__all__ = [
    "HIDDEN_VERSION", "MAX_BATCH", "MAX_DRAFTED", "MAX_PAYLOAD_BYTES", "MAX_RID_CHARS",
    "MAX_TOP_N", "NEW_REQUEST_VERSION", "OUTCOME_VERSION", "PLAN_VERSION", "PROPOSAL_VERSION",
    "PROTOCOL_VERSION", "RANK_REPORT_VERSION", "SAMPLING_FIELDS", "EngineCall", "HiddenStates",
    "NewRequest", "Proposal", "ProtocolError", "RankReport",
    "StepColumns", "StepOutcome", "StepPlan", "VerifyStep", "columns_from_step",
    "decode", "decode_columns", "decode_hidden", "decode_new_request", "decode_outcome",
    "decode_plan", "decode_proposal", "decode_rank_report", "draft_room", "encode",
    "encode_columns", "encode_hidden", "encode_new_request", "encode_outcome", "encode_plan",
    "encode_proposal", "encode_rank_report", "validate_columns",
]
