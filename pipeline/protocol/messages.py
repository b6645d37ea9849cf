"""The messages of one engine step, between the engine and its stages (draft, verifier ranks,
output), declared together:

    NewRequest   engine -> output stage (registration) and, inside a plan, -> draft and verifier
    StepPlan     engine -> draft worker and every verifier rank
    Proposal     draft worker -> verifier ranks
    StepOutcome  verifier rank 0 -> engine (the full VerifyStep goes to the output stage)
    HiddenStates inside an outcome, then the next plan: aux hidden states for an EAGLE-3 draft
    RankReport   every other verifier rank -> engine (its KV digest, checked against rank 0's)

In one process they pass as these objects; between processes each is versioned msgpack
(pipeline.protocol.step_codec), like the VerifyStep (pipeline.protocol.verify_step).

Every stage keeps its own per-request state keyed by rid (slot, sequence), so a plan carries
only ids and the few numbers that change per step. Order inside a stage: free `release`,
register `new`, apply `commits`, then draft / verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.params import SamplingParams


def draft_room(max_len: int, kv_len: int) -> int:
    """Drafts that fit a slot of `max_len` positions holding `kv_len` committed tokens: the
    request's newest token takes one position, each draft one more."""
    return max(0, max_len - kv_len - 1)


@dataclass
class NewRequest:
    rid: str
    prompt_ids: list[int]  # what the stages prefill: the prompt (+ output so far, if resumed)
    params: SamplingParams
    # a hash of the API key and `user` it came from (pipeline.frontend.tenant; "" = anonymous):
    # state shared across requests (suffix drafting's index) is shared within a tenant only
    tenant: str = ""
    # output tokens already generated (> 0: a preempted request recomputed; the last
    # `num_output` of prompt_ids are its output, and the prefill's token is output position
    # num_output)
    num_output: int = 0
    # chunked prefill: prompt tokens the stages compute this step past its cached prefix (None:
    # all of them). Its first token comes only from the step whose chunk reaches the prompt's
    # end; until then the plan carries it in `prefills` (StepPlan)
    chunk: int | None = None


@dataclass
class HiddenStates:
    """The target's aux hidden states at the positions a step kept: request i's
    positions starts[i]..starts[i]+counts[i]-1 are `rows`' next counts[i] rows ([sum(counts),
    n_aux * H] on the CPU, float32, float16 or bfloat16)."""

    rids: list[str]
    starts: list[int]
    counts: list[int]
    rows: Any

    def split(self) -> list[Any]:
        return list(self.rows.split(self.counts)) if self.rids else []


@dataclass
class StepPlan:
    step: int
    # finished/aborted/preempted: free their slots first (a preempted rid may come back later
    # in `new`, with its output so far in its prompt)
    release: list[str] = field(default_factory=list)
    new: list[NewRequest] = field(default_factory=list)  # prefill this step (drafted = 0)
    # requests continuing a chunked prefill: compute prompt positions [start, end) (the stages'
    # KV holds exactly `start` of them); the chunk ending at the prompt's end yields the token
    prefills: list[str] = field(default_factory=list)
    prefill_starts: list[int] = field(default_factory=list)
    prefill_ends: list[int] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)  # verify this step
    last_tokens: list[int] = field(default_factory=list)  # per decode rid: newest token, not in KV
    kv_lens: list[int] = field(default_factory=list)  # per decode rid: committed KV length
    num_outputs: list[int] = field(default_factory=list)  # per decode rid: output tokens so far
    ks: list[int] = field(default_factory=list)  # per decode rid: drafts to verify (controller)
    # per decode rid: the most drafts room and length allow; a proposer that scores its drafts
    # drafts up to it and keeps those scored at least min_gains (pipeline.engine.spec); empty: ks
    caps: list[int] = field(default_factory=list)
    min_gains: list[float] = field(default_factory=list)
    commits: dict[str, list[int]] = field(default_factory=dict)  # last step's tokens, per rid
    # a released request's last step's tokens, never committed (a proposer that learns from
    # finished outputs, e.g. suffix drafting's global index, keeps the whole output)
    finals: dict[str, list[int]] = field(default_factory=dict)
    traceparent: str | None = None
    hidden: HiddenStates | None = None  # the last outcome's, for an EAGLE-3 draft stage

    @property
    def rids(self) -> list[str]:
        """The step's requests in forward order: new prefills, continuing prefill chunks, then
        verifies. The outcome holds only those that yield a token: the prefills whose chunk
        ended their prompt (same order), then every verify."""
        return [n.rid for n in self.new] + self.prefills + self.decode

    @property
    def num_tokens(self) -> int:
        """The most tokens the step's target forward computes (what `max_num_batched_tokens`
        bounds): each prefill's chunk (its whole prompt when unchunked; a cache hit only makes
        it less) and 1 + the draft bound per verify."""
        return (sum(len(n.prompt_ids) if n.chunk is None else n.chunk for n in self.new)
                + sum(e - s for s, e in zip(self.prefill_starts, self.prefill_ends))
                + sum(k + 1 for k in self.draft_bounds))

    @property
    def draft_bounds(self) -> list[int]:
        """Per decode rid, the most drafts this step may carry: the caps (the scheduler's room
        and length rule; the controller's ks never exceed them), or ks when a plan has no caps.
        Every stage reads the bound here: the drafter drafts no more, the verifier verifies no
        more, the stall detector sizes the step by it."""
        return self.caps or self.ks

    def draft_limits(self, max_len: int) -> list[int]:
        """`draft_bounds`, never past a slot of `max_len` positions (a plan built by hand)."""
        return [min(b, draft_room(max_len, kv)) for b, kv in zip(self.draft_bounds, self.kv_lens)]


@dataclass
class Proposal:
    """Drafts for one step, aligned with the rids the step asked for.

    `probs[i]` is the draft distribution q each token of `tokens[i]` was sampled from
    ([len(tokens[i]), vocab] float32: a CPU torch tensor from the proposer, a numpy array after
    crossing a process) when the proposer sampled; None means the drafts are deterministic (a
    point mass on each token: greedy draft models, n-gram lookup).

    `confidence[i][j]`, when the proposer can tell, estimates the chance that drafts 0..j of
    request i are all accepted (so non-increasing in j; their sum is the expected accepted
    length); a controller may verify only a prefix of the drafts by it. None: no estimate."""

    tokens: list[list[int]]
    probs: list[Any | None] | None = None
    confidence: list[list[float]] | None = None
    seconds: float = 0.0  # time the proposer took (the engine's step-cost model uses it)


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
    # rank 0's KV digest after the step (pipeline.models.kv_cache.KVCache.digest); b"": none
    kv_digest: bytes = b""
    # set by the engine's side, never encoded: verified without a proposal because the draft
    # stage was lost (pipeline.engine.draft_failover), not because the controller chose k = 0
    undrafted: bool = False
    hidden: HiddenStates | None = None  # the kept positions' aux states (draft: eagle3)


@dataclass
class RankReport:
    """A tensor-parallel rank other than 0 after a step: its KV digest, which must equal rank
    0's (pipeline.verify.ranks.check_rank_reports)."""

    step: int
    rank: int
    kv_digest: bytes
