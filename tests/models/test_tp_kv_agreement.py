"""Tensor-parallel ranks hold the same KV blocks, or the engine fails loudly.

Each rank runs its own deterministic block manager; rank 0's outcome carries a digest of its
block tables after every step and the other ranks report theirs (pipeline.verify.ranks); before
a prefilling forward the ranks compare digests among themselves (pipeline.models.tp). Here:
- the check and its message (unit);
- two replicas fed the same plans (in-process, no collectives) agree through a run with prefix
  hits and preemption; a replica whose pool differs fails the engine with KVDivergenceError;
- TP = 2 over gloo (two spawned processes, the plan and proposal crossing as msgpack as they do
  between actors): greedy output with the prefix cache on equals off equals TP = 1, also with
  steps sent ahead (rank 0 broadcasts its samples), and a rank whose cache disagrees makes both
  ranks raise before the forward.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import random

import pytest

from pipeline.config import load_config
from pipeline.engine.local import LocalStages, build_local_engine, collect
from pipeline.errors import EngineDeadError, KVDivergenceError
from pipeline.params import SamplingParams
from pipeline.protocol import (
    ProtocolError,
    RankReport,
    StepOutcome,
    decode_outcome,
    decode_rank_report,
    encode_outcome,
    encode_rank_report,
)
from pipeline.verify.ranks import check_rank_reports

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
D0, D1 = bytes(range(16)), bytes(range(1, 17))


def test_rank_reports_must_match_rank_zeros_digest_and_step():
    outcome = StepOutcome(7, [], [], [], kv_digest=D0)
    check_rank_reports(outcome, [RankReport(7, 1, D0), RankReport(7, 2, D0)])
    with pytest.raises(KVDivergenceError, match=r"step 7: .* rank 0 000102.* rank 2 \(step 7"):
        check_rank_reports(outcome, [RankReport(7, 1, D0), RankReport(7, 2, D1)])
    with pytest.raises(KVDivergenceError, match=r"rank 1 \(step 6"):
        check_rank_reports(outcome, [RankReport(6, 1, D0)])


def test_rank_report_and_outcome_digest_cross_as_msgpack():
    assert decode_rank_report(encode_rank_report(RankReport(3, 1, D1))) == RankReport(3, 1, D1)
    assert decode_outcome(encode_outcome(StepOutcome(3, [], [], [], kv_digest=D0))).kv_digest == D0
    with pytest.raises(ProtocolError, match="rank.rank"):
        decode_rank_report(encode_rank_report(RankReport(3, 0, D1)))  # rank 0 sends outcomes
    with pytest.raises(ProtocolError, match="rank.kvd"):
        decode_rank_report(encode_rank_report(RankReport(3, 1, b"x" * 65)))
    import msgpack

    msg = msgpack.unpackb(encode_outcome(StepOutcome(3, [], [], [], kv_digest=D0)))
    with pytest.raises(ProtocolError, match="outcome.kvd"):
        decode_outcome(msgpack.packb({**msg, "kvd": "text"}))
    with pytest.raises(ProtocolError, match="expected a 'rank' message"):
        decode_rank_report(encode_outcome(StepOutcome(3, [], [], [], kv_digest=D0)))


def _requests(round_: int, n: int = 6):
    """Requests sharing a 64-token system prefix (prefix hits from the second round on)."""
    system = [random.Random(0).randrange(3, 250) for _ in range(64)]
    rng = random.Random(round_ + 1)
    return [(f"q{i}-{round_}", system + [rng.randrange(3, 250) for _ in range(5 + 3 * i)],
             SamplingParams(max_new_tokens=20, ignore_eos=True)) for i in range(n)]


class ReplicaStages(LocalStages):
    """A second verifier (a full replica standing in for rank 1: same calls, its own pool), fed
    the same plans and proposals; its report is checked as the Ray engine checks rank 1's."""

    shadow = None

    def step(self, plan):
        from pipeline.draft.step import draft_step

        proposal = draft_step(self.proposer, plan, self.grammars)
        outcome = self.verifier.step(plan, proposal)
        self.shadow.step(plan, proposal)
        check_rank_reports(outcome, [self.shadow.report(plan.step, 1)])
        return outcome


def _replica_engine(overrides: dict, take_block: bool = False):
    from pipeline.models.runners import build_runner
    from pipeline.verify.verifier import Verifier

    config = load_config(CONFIG, {"attention_backend": "sdpa", "draft": "ngram", **overrides})
    core = build_local_engine(config, stages_type=ReplicaStages)
    shadow_runner = build_runner(config, "target")
    if take_block:  # a rank whose pool differs by one block
        shadow_runner.cache.blocks.add(999)
        shadow_runner.cache.blocks.ensure(999, 1)
    core.stages.shadow = Verifier(shadow_runner, driver=False)
    return core


async def _rounds(core, rounds: int = 2, between=lambda: None):
    out = {}
    for r in range(rounds):
        if r:
            between()
        got = await collect(core, _requests(r))
        out.update({rid: c.token_ids for rid, c in got.items()})
    return out


def test_replicas_fed_the_same_plans_hold_the_same_blocks_through_hits_and_preemption():
    core = _replica_engine({"kv_cache_tokens": 256})  # 16 blocks: preemption
    out = asyncio.run(_rounds(core))
    assert core.stats.prefix_hits > 0 and core.scheduler.preemptions > 0
    assert core.dead_reason is None and len(out) == 12
    assert core.stages.shadow.kv_digest == core.stages.verifier.kv_digest


def test_a_replica_holding_other_blocks_fails_the_engine_with_kv_divergence():
    core = _replica_engine({}, take_block=True)
    with pytest.raises(EngineDeadError, match="KVDivergenceError.*step 0"):
        asyncio.run(_rounds(core, 1))


# --- TP = 2 over gloo ---------------------------------------------------------------------------
def _tp_config(caching: bool, **overrides):
    return load_config("configs/tiny-tp2.yaml", {
        "attention_backend": "sdpa", "draft": "ngram", "enable_prefix_caching": caching,
        "tensor_parallel_size": 1, **overrides})  # the in-process engine drives both ranks


def _rank_runner(rank: int, caching: bool):
    from pipeline.models.runners import build_runner

    return build_runner(_tp_config(caching), "target", tp_rank=rank, tp_world=2)


def _rank1(conn, init: str) -> None:
    """Rank 1: build on request, then run each plan it is sent and report its digest."""
    import torch

    from pipeline.models.tp import check_ranks_agree, init_distributed, share_from_rank0
    from pipeline.protocol import decode_plan, decode_proposal
    from pipeline.verify.verifier import Verifier

    torch.set_num_threads(1)
    init_distributed(1, 2, init, backend="gloo")
    verifier = None
    while (msg := conn.recv())[0] != "stop":
        if msg[0] == "build":
            verifier = Verifier(_rank_runner(1, msg[1]), driver=False, agree=check_ranks_agree,
                                share=share_from_rank0)
            continue
        if msg[0] == "forget":  # a bug stand-in: hidden state (the cache index) diverges
            verifier.runner.cache.blocks._cached.clear()
            continue
        plan = decode_plan(msg[1])
        try:
            verifier.step(plan, None if msg[2] is None else decode_proposal(msg[2]))
            conn.send(("ok", encode_rank_report(verifier.report(plan.step, 1))))
        except KVDivergenceError as e:
            conn.send(("error", str(e)))


class PipeStages(LocalStages):
    """Rank 0's stages: the plan and proposal go to rank 1 as msgpack, both ranks verify in
    lockstep, rank 1's report is checked (as actors.engine.RayStages does)."""

    conn = None

    def step(self, plan):
        from pipeline.draft.step import draft_step
        from pipeline.protocol import encode_plan, encode_proposal

        proposal = draft_step(self.proposer, plan, self.grammars)
        self.conn.send(("step", encode_plan(plan), encode_proposal(proposal)))
        try:
            outcome = self.verifier.step(plan, proposal)
        finally:
            status, report = self.conn.recv()  # rank 1's answer, whatever happened here
        assert status == "ok", report
        check_rank_reports(outcome, [decode_rank_report(report)])
        return outcome


def _rank0(conn, init: str, out_path: str) -> None:
    import torch

    from pipeline.draft.step import build_proposer
    from pipeline.engine.core import EngineCore
    from pipeline.engine.local import make_output_processor
    from pipeline.models.tp import check_ranks_agree, init_distributed, share_from_rank0
    from pipeline.tokenizer import eos_token_ids
    from pipeline.verify.verifier import Verifier

    torch.set_num_threads(1)
    init_distributed(0, 2, init, backend="gloo")
    results = {}
    for label, mine, theirs in (("on", True, True), ("off", False, False), ("ahead", True, True),
                                ("forgot", True, True), ("diverged", True, False)):
        conn.send(("build", theirs))
        config = _tp_config(mine, **({"draft": "none", "async_scheduling": "on"}
                                     if label == "ahead" else {}))
        runner = _rank_runner(0, mine)
        output = make_output_processor(runner.tokenizer, eos_token_ids(runner.tokenizer))
        stages = PipeStages(build_proposer(config), Verifier(runner, agree=check_ranks_agree,
                                                             share=share_from_rank0), output)
        stages.conn = conn
        core = EngineCore(config, stages, runner.vocab_size)
        forget = (lambda: conn.send(("forget",))) if label == "forgot" else (lambda: None)
        try:
            results[label] = (asyncio.run(_rounds(core, between=forget)), core.stats.prefix_hits)
            results[f"{label} steps ahead"] = core.stats.steps_ahead
        except EngineDeadError as e:
            results[label] = str(e)
    conn.send(("stop",))
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


def test_tp2_greedy_output_is_the_same_with_the_prefix_cache_on_and_off_and_as_tp1(tmp_path):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    init = f"file://{tmp_path / 'init'}"
    out_path = str(tmp_path / "out.pkl")
    procs = [ctx.Process(target=_rank0, args=(a, init, out_path)),
             ctx.Process(target=_rank1, args=(b, init))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    with open(out_path, "rb") as f:
        results = pickle.load(f)
    ref = asyncio.run(_rounds(build_local_engine(
        load_config(CONFIG, {"attention_backend": "sdpa", "draft": "none",
                             "enable_prefix_caching": False}))))
    on, on_hits = results["on"]
    off, off_hits = results["off"]
    assert on == off == results["ahead"][0] == ref
    assert on_hits > 0 and off_hits == 0
    assert results["ahead steps ahead"] > 0 and results["on steps ahead"] == 0
    # hidden state diverged (rank 1 lost its cache index): the ranks stop before the forward
    assert "KVDivergenceError" in results["forgot"]
    assert "prefix-cache hits" in results["forgot"] and "[0] vs [1]" in results["forgot"]
    # visible state diverged (rank 1 caches nothing): the step's reports disagree
    assert "KVDivergenceError" in results["diverged"]
    assert "hold different KV blocks" in results["diverged"]


def test_block_histories_match_for_the_same_calls_and_never_again_after_one_differs():
    from pipeline.models.block_manager import BlockManager

    def run(bm, hit_tokens):
        bm.add(0)
        bm.ensure(0, 40)
        bm.commit(0, [7] * 40)
        bm.remove(0)
        bm.add(1)
        bm.attach(1, hit_tokens, len(hit_tokens) - 1)
        bm.ensure(1, 50)
        bm.truncate(1, 45)
        return bm.history

    a, b, c = (BlockManager(8, 16, prefix_caching=True) for _ in range(3))
    assert run(a, [7] * 40) == run(b, [7] * 40) != b""
    assert run(c, [7] * 16 + [8] * 24) != a.history  # one hit fewer
    for bm in (a, c):  # the same calls afterwards: still apart
        bm.remove(1)
    assert a.history != c.history and a.num_free == c.num_free
