"""A failed engine keeps the stages that answer a reset (pipeline.engine.stage_rebuild), in
process: which stages are replaced, and that kept stages, reset, serve a new EngineCore (empty
scheduler) exactly as fresh ones would: same ids again, greedy equal to target-only, every KV
slot free, the draft and output stages empty."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import pytest
from support.engine_cases import PROMPTS
from support.reference_decode import target_references

from pipeline.config import load_config
from pipeline.draft.step import build_proposer, reset_draft
from pipeline.engine.core import EngineCore
from pipeline.engine.local import LocalStages
from pipeline.engine.stage_rebuild import Replace, answered, stages_to_replace, until_built
from pipeline.errors import EngineDeadError
from pipeline.models.runners import build_runner
from pipeline.output.processor import OutputProcessor
from pipeline.output.request_output import Completion
from pipeline.output.spans import TracedOutputProcessor
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall, StepPlan
from pipeline.tokenizer import eos_token_ids
from pipeline.verify.verifier import Verifier

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"


async def _ok() -> bool:
    return True


async def _dead() -> bool:
    raise RuntimeError("actor died")


async def _hang() -> bool:
    await asyncio.sleep(60)
    return True


def _replace(draft: Any, ranks: list[Any], output: Any, timeout_s: float = 0.3
             ) -> tuple[Replace, float]:
    async def main() -> Replace:
        return await stages_to_replace(draft and draft(), [r() for r in ranks], output(),
                                       timeout_s)

    t0 = time.monotonic()
    replace = asyncio.run(main())
    return replace, time.monotonic() - t0


def test_the_stages_that_answer_are_kept():
    assert _replace(_ok, [_ok, _ok], _ok)[0] == Replace(False, False, False)
    replace, _ = _replace(_ok, [_ok], _dead)  # the output actor died
    assert replace == Replace(draft=False, verifiers=False, output=True)
    assert replace.describe() == "output" and not replace.everything
    replace, _ = _replace(None, [_ok], _ok)  # a draft being replaced is replaced
    assert replace == Replace(draft=True, verifiers=False, output=False)
    assert _replace(None, [_dead], _dead)[0].everything


def test_one_dead_rank_replaces_every_rank_at_once_though_its_peer_hangs():
    # the survivor is stuck in a collective with the dead rank: no need to wait for it
    replace, took = _replace(_ok, [_hang, _dead], _ok, timeout_s=5.0)
    assert replace == Replace(draft=False, verifiers=True, output=False)
    assert replace.describe() == "verifier ranks"
    assert took < 1.0


def test_a_stage_that_does_not_answer_in_time_is_replaced():
    replace, took = _replace(_ok, [_ok, _ok], _hang, timeout_s=0.2)
    assert replace == Replace(draft=False, verifiers=False, output=True)
    assert 0.2 <= took < 2.0
    assert asyncio.run(answered([], 0.1))


def test_a_failed_rebuild_is_tried_again_after_growing_pauses_until_one_succeeds():
    attempts: list[float] = []
    reports: list[str] = []

    async def attempt() -> None:
        attempts.append(time.monotonic())
        if len(attempts) <= 3:
            raise RuntimeError(f"new rank died while it loaded ({len(attempts)})")

    failed = asyncio.run(until_built(attempt, reports.append, first_pause_s=0.05,
                                     max_pause_s=0.1))
    assert failed == 3 and len(attempts) == 4
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.1  # doubled from the first
    assert "attempt 3 failed (RuntimeError: new rank died while it loaded (3))" in reports[2]
    assert len(reports) == 3


def test_a_cancelled_rebuild_stops_trying():
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("never places")

    async def main() -> None:
        task = asyncio.ensure_future(until_built(attempt, lambda _: None, first_pause_s=0.05))
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    seen = calls
    assert 2 <= seen <= 3
    time.sleep(0.1)
    assert calls == seen


class FailingStages(LocalStages):
    """LocalStages whose output stage fails from step `fail_at` on (as a dead output actor's
    calls do); `reset` waits for a step still running in its thread, as a Ray actor's ordered
    calls run after the step in flight."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.fail_at: int | None = None
        self.last_step = -1
        self.lock = threading.Lock()

    def step(self, plan: StepPlan) -> Any:
        self.last_step = plan.step
        with self.lock:
            return super().step(plan)

    async def process(self, payload: bytes) -> list:
        if self.fail_at is not None and self.last_step >= self.fail_at:
            raise RuntimeError("output actor died")
        return await super().process(payload)

    def reset(self) -> int:
        """What the engine's rebuild asks of each kept stage; the verifier's count."""
        with self.lock:
            reset_draft(self.proposer, self.grammars)
            self.output.reset()
            return self.verifier.reset()


async def _serve(core: EngineCore, rids: list[str], tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)

    async def one(i: int, rid: str) -> Any:
        stream = await core.add_request(EngineCall(rid, PROMPTS[i], params))
        try:
            return Completion.fold([d async for d in stream])
        except EngineDeadError as e:
            return e

    core.start()
    done = await asyncio.gather(*(one(i, r) for i, r in enumerate(rids)))
    await core.idle()
    await core.stop()
    return dict(zip(rids, done))


def test_kept_stages_reset_serve_a_new_core_like_fresh_ones():
    config = load_config(CONFIG, {"speculation": "fixed"})
    runner = build_runner(config, "target")
    output = TracedOutputProcessor(OutputProcessor(runner.tokenizer,
                                                   eos_token_ids(runner.tokenizer)))
    stages = FailingStages(build_proposer(config), Verifier(runner), output)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    slots, blocks = runner.num_free(), runner.num_free_blocks()

    stages.fail_at = 5  # mid-generation: every request is running
    first = EngineCore(config, stages, runner.vocab_size)
    failed = asyncio.run(_serve(first, rids, 40))
    assert all(isinstance(r, EngineDeadError) for r in failed.values()), failed
    assert runner.num_free() < slots and stages.proposer.requests()  # the failed ones' state

    assert stages.reset() == len(rids)  # the verifier held every request
    assert runner.num_free() == slots and stages.proposer.requests() == []
    assert output.inner.num_requests == 0 and not output._live
    # the prefix cache may keep blocks: every block is free or cached, none held by a slot
    assert runner.num_free_blocks() <= blocks

    stages.fail_at = None
    want = target_references(CONFIG, PROMPTS, 30)
    second = EngineCore(config, stages, runner.vocab_size)  # an empty scheduler
    done = asyncio.run(_serve(second, rids, 30))  # the same ids again
    for i, rid in enumerate(rids):
        assert list(done[rid].token_ids) == want[i], rid
    assert second.stats.draft_tokens > 0  # the kept draft stage drafted
    assert runner.num_free() == slots
