"""What the engine tells the draft worker and every verifier rank for one step.

Every stage keeps its own per-request state keyed by rid (slot, sequence), so a plan carries
only ids and the few numbers that change per step. Order inside a stage: free `release`,
register `new`, apply `commits`, then draft / verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.params import SamplingParams


@dataclass
class NewRequest:
    rid: str
    prompt_ids: list[int]  # what the stages prefill: the prompt (+ output so far, if resumed)
    params: SamplingParams
    # output tokens already generated (> 0: a preempted request recomputed; the last
    # `num_output` of prompt_ids are its output, and the prefill's token is output position
    # num_output)
    num_output: int = 0


@dataclass
class StepPlan:
    step: int
    # finished/aborted/preempted: free their slots first (a preempted rid may come back later
    # in `new`, with its output so far in its prompt)
    release: list[str] = field(default_factory=list)
    new: list[NewRequest] = field(default_factory=list)  # prefill this step (drafted = 0)
    decode: list[str] = field(default_factory=list)  # verify this step
    last_tokens: list[int] = field(default_factory=list)  # per decode rid: newest token, not in KV
    kv_lens: list[int] = field(default_factory=list)  # per decode rid: committed KV length
    num_outputs: list[int] = field(default_factory=list)  # per decode rid: output tokens so far
    ks: list[int] = field(default_factory=list)  # per decode rid: drafts to verify (controller)
    # per decode rid: the most drafts room and length allow; a proposer that scores its drafts
    # drafts up to it and keeps those scored at least min_gains (spec_control); empty: ks
    caps: list[int] = field(default_factory=list)
    min_gains: list[float] = field(default_factory=list)
    commits: dict[str, list[int]] = field(default_factory=dict)  # last step's tokens, per rid
    # a released request's last step's tokens, never committed (a proposer that learns from
    # finished outputs, e.g. suffix drafting's global index, keeps the whole output)
    finals: dict[str, list[int]] = field(default_factory=dict)
    traceparent: str | None = None

    @property
    def rids(self) -> list[str]:
        """The step's requests in message order: prefills, then verifies."""
        return [n.rid for n in self.new] + self.decode


@dataclass
class StepOutcome:
    """What the engine needs back from a verify step (rank 0); the full message goes to the
    output stage as `payload` (msgpack bytes)."""

    step: int
    rids: list[str]
    tokens: list[list[int]]  # accepted drafts + target token, per rid (before finish truncation)
    drafted: list[int]
    expected: list[float | None] | None = None  # per rid: the verified drafts' summed confidence
    payload: Any = b""  # the msgpack message (bytes), or under Ray an object ref to it
    # seconds drafting + verifying the decodes; None when the step also prefilled (one forward)
    decode_s: float | None = None
    # per prefill (plan.new order): prompt tokens whose KV came from the prefix cache
    cached: list[int] = field(default_factory=list)
