"""Lossless speculation, with evidence that cannot pass vacuously (in-process engine, tiny model):
stop ids and stop strings fire in the step the greedy reference says, after drafts were rejected,
under adaptive k, for the model draft and n-gram; and sampling through the speculative engine
keeps the target's distribution, a test a deliberately wrong acceptance rule fails."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
import torch
from support.eagle3_heads import eagle_config, head_tensors, write_head
from support.engine_cases import LOSSY_PROMPT
from support.reference_decode import chi2_pvalue, target_references

from pipeline.config import load_config
from pipeline.engine.local import LocalStages, build_local_engine
from pipeline.models.runners import tiny_tokenizer
from pipeline.models.tiny import tiny_config
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall
from pipeline.sampling import process_logits
from pipeline.verify import acceptance

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
PROMPT = LOSSY_PROMPT
TOK = tiny_tokenizer()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return target_references(CONFIG, [PROMPT], 40)[0]


class Recording(LocalStages):
    """LocalStages that keep each step's (step id, rids, tokens, drafted)."""

    steps: ClassVar[list] = []  # the test's own record, reset by run()

    async def run_step(self, plan):
        outcome = await super().run_step(plan)
        if outcome.rids:  # not a release-only step
            self.steps.append((outcome.step, outcome.rids, outcome.tokens,
                               outcome.drafted))
        return outcome


def run(overrides: dict, params: SamplingParams):
    Recording.steps = []
    core = build_local_engine(load_config(CONFIG, overrides), stages_type=Recording)

    async def go():
        core.start()
        return [d async for d in await core.add_request(EngineCall("r", PROMPT, params))]

    return asyncio.run(go()), Recording.steps


def stop_position(ref: list[int], start: int) -> int:
    """First position >= start whose token occurs nowhere earlier and is not EOS (2)."""
    return next(p for p in range(start, len(ref)) if ref[p] not in ref[:p] and ref[p] != 2)


@pytest.mark.parametrize("draft,overrides", [
    ("ngram", {}), ("suffix", {"num_speculative_tokens": 8}),
    ("model", {"draft_agreement_noise": 0.6})])
@pytest.mark.parametrize("kind", ["stop_id", "stop_string"])
def test_a_stop_fires_in_the_reference_step_after_rejected_drafts(reference, draft, overrides,
                                                                  kind):
    f = stop_position(reference, 12)
    if kind == "stop_id":
        params = SamplingParams(max_new_tokens=40, stop_token_ids=[reference[f]])
        matched = reference[f]
    else:
        matched = TOK.decode([reference[f]])
        assert matched and matched not in TOK.decode(reference[:f])  # test design
        params = SamplingParams(max_new_tokens=40, stop=[matched])
    deltas, steps = run({"draft": draft, "speculation": "adaptive", **overrides}, params)
    last = deltas[-1]
    assert (last.finish_reason, last.matched_stop, last.finished_len) == ("stop", matched, f + 1)
    assert [t for d in deltas for t in d.token_ids] == reference[: f + 1]
    # In which step: the one whose window holds output position f.
    pos, fired_in = 0, None
    for step, _, tokens, _ in steps:
        if pos <= f < pos + len(tokens[0]):
            fired_in = step
            break
        pos += len(tokens[0])
    assert last.finish_step == fired_in
    # After rejected drafts: an earlier step verified drafts and kept fewer than it drafted.
    earlier = [(tokens[0], drafted[0]) for step, _, tokens, drafted in steps if step < fired_in]
    assert any(len(t) - 1 < d for t, d in earlier)
    # ...and adaptive k varied the drafts (not every step at the cap).
    assert len({d for _, d in earlier}) > 1


@pytest.mark.parametrize("draft", ["model", "eagle3"])
def test_sampling_through_the_speculative_engine_keeps_the_target_distribution(monkeypatch,
                                                                              tmp_path, draft):
    """Second tokens given the most common first token, over many unseeded requests, against the
    target's exact processed distribution; accepting every draft the target could produce fails the same test."""
    # 3 tokens: the first decode step may draft one (the cap is what the length limit leaves).
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    cfg = {"draft": "model", "draft_agreement_noise": 0.5, "speculation": "fixed",
           "num_slots": 8}
    if draft == "eagle3":  # a random head on the 2-layer target: it names its layers
        target = tiny_config()
        write_head(tmp_path, eagle_config(target, eagle_aux_hidden_state_layer_ids=[0, 1, 1]),
                   head_tensors(target, seed=5))
        cfg = {**cfg, "draft": "eagle3", "eagle3_head": str(tmp_path)}

    def pvalue(n: int = 400) -> float:
        torch.manual_seed(0)
        core = build_local_engine(load_config(CONFIG, cfg))

        async def go():
            core.start()
            outs = []
            for i in range(0, n, 8):
                streams = [await core.add_request(EngineCall(f"s{i + j}", PROMPT, params))
                           for j in range(8)]
                for s in streams:
                    outs.append([t for d in [d async for d in s] for t in d.token_ids])
            await core.idle()
            return outs

        outs = asyncio.run(go())
        first = max({o[0] for o in outs}, key=[o[0] for o in outs].count)
        runner = core.stages.verifier.runner
        slot = runner.allocate()
        logits = runner.forward([slot], [PROMPT + [first]], last_only=True)[0][-1:]
        runner.free(slot)
        probs = process_logits(logits, torch.tensor([1.0]), torch.tensor([3]),
                               torch.tensor([1.0]))[0]
        counts = torch.bincount(torch.tensor([o[1] for o in outs if o[0] == first]),
                                minlength=probs.shape[-1])
        return chi2_pvalue(counts, probs)

    assert pvalue() > 1e-3
    if draft == "eagle3":
        # its drafts are point masses that seldom land in the target's top 3, where the
        # acceptance rule decides: the wrong rule below would change too little to detect
        return
    real = acceptance.rejection_accept

    def accepts_every_possible_draft(draft_ids, num_drafts, target_probs, draft_probs,
                                     accept_u, sample_u):
        # Wrong: a draft the target could produce at all (p(x) > 0) is always accepted.
        return real(draft_ids, num_drafts, target_probs, draft_probs, accept_u * 0, sample_u)

    monkeypatch.setattr(acceptance, "rejection_accept", accepts_every_possible_draft)
    assert pvalue() < 1e-3
