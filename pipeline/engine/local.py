"""The whole engine in one process (no Ray, so one rank): the step loop over local stages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pipeline.config import EngineConfig
from pipeline.draft.base import Proposer
from pipeline.draft.eagle3.proposer import verifier_aux_layers
from pipeline.draft.step import build_proposer, draft_step
from pipeline.engine.core import EngineCore
from pipeline.grammar.memory import set_memory_budget
from pipeline.grammar.tracker import GrammarTracker
from pipeline.models.runners import build_runner
from pipeline.output.processor import OutputProcessor
from pipeline.output.request_output import Completion, RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall, NewRequest, StepOutcome, StepPlan
from pipeline.tokenizer import eos_token_ids
from pipeline.verify.verifier import Verifier


class LocalStages:
    sends_ahead = False  # no hop to hide, and its thread would contend with the loop's

    def __init__(self, proposer: Proposer, verifier: Verifier, output: Any) -> None:
        self.proposer = proposer
        self.verifier = verifier
        self.output = output
        self.grammars = GrammarTracker(lambda: verifier.runner.tokenizer)
        self._steps_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def add_request(self, req: NewRequest, traceparent: str | None) -> None:
        self.output.add_request(req.rid, req.prompt_ids, req.params)

    async def run_step(self, plan: StepPlan) -> StepOutcome:
        # off the loop (a client queues its next request meanwhile), in order, as an actor's
        async with self._steps():
            return await asyncio.to_thread(self.step, plan)

    def _steps(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()  # a lock belongs to the loop that first waits on it
        if self._steps_lock is None or self._steps_lock[0] is not loop:
            self._steps_lock = (loop, asyncio.Lock())
        return self._steps_lock[1]

    def step(self, plan: StepPlan) -> StepOutcome:
        outcome = self.verifier.step(plan, draft_step(self.proposer, plan, self.grammars))
        assert outcome is not None
        return outcome

    async def process(self, payload: bytes) -> list[RequestOutput]:
        return self.output.process(payload)

    async def abort(self, rid: str) -> RequestOutput | None:
        return self.output.abort(rid)

    async def dropped_steps(self) -> int:
        return int(self.output.dropped_steps)


def make_output_processor(tokenizer: Any, eos_token_ids: list[int]) -> Any:
    return OutputProcessor(tokenizer, eos_token_ids)


def build_local_engine(config: EngineConfig, runner: Any = None, proposer: Proposer | None = None,
                       stages_type: type[LocalStages] = LocalStages) -> EngineCore:
    """`runner` reuses a loaded target (its slots free; engines sharing it never run at once)."""
    if config.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: the in-process engine runs one rank; use Ray")
    set_memory_budget(config.grammar_memory_mb << 20)
    runner = runner or build_runner(config, "target")
    output = make_output_processor(runner.tokenizer, eos_token_ids(runner.tokenizer))
    aux = verifier_aux_layers(config, runner.config)
    stages = stages_type(proposer or build_proposer(config), Verifier(runner, aux_layers=aux),
                         output)
    return EngineCore(config, stages, runner.vocab_size)


async def collect(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]]
                  ) -> dict[str, Completion]:
    async def one(rid: str, prompt: list[int], params: SamplingParams) -> Completion:
        stream = await core.add_request(EngineCall(rid, prompt, params))
        return Completion.fold([d async for d in stream])

    core.start()
    results = await asyncio.gather(*(one(*r) for r in requests))
    await core.idle()  # slots freed: the runner may serve another engine
    return {c.rid: c for c in results}


class LocalEngineClient:

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    async def generate(self, call: EngineCall) -> AsyncIterator[RequestOutput]:
        self.core.start()
        stream = await self.core.add_request(call)
        yield RequestOutput(call.rid)  # queued (see actors.engine_client.EngineClient.generate)
        async for delta in stream:
            yield delta

    async def abort(self, rid: str) -> None:
        await self.core.abort(rid)

    async def stats(self) -> dict[str, Any]:
        return {**await self.core.stats_dict(), "restarts": 0}

    async def health(self) -> dict[str, Any]:
        return self.core.health()

    async def model_info(self) -> dict[str, Any]:
        c = self.core.config
        return {"name": c.served_name, "source": c.model, "max_model_len": c.max_model_len,
                "vocab_size": self.core.scheduler.vocab_size, "eos_token_ids": []}
