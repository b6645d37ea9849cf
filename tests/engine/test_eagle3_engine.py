"""`draft: eagle3` in the in-process engine (an 8-layer tiny target, a random tiny head): greedy
output equals target-only; the head is fed the target's own aux states at every position, in
order, each with the token after it (checked against a recompute from scratch), through chunked
prefill and accepted drafts; prefix-cache reuse is off for it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.eagle3_heads import eagle_config, head_tensors, tiny_target_config, write_head
from support.engine_cases import PROMPTS
from support.reference_decode import greedy_reference

from pipeline.config import load_config
from pipeline.draft.eagle3.proposer import Eagle3Proposer, build_eagle3_proposer, head_aux_layers
from pipeline.engine.local import build_local_engine, collect
from pipeline.models.runners import load_runner, tiny_tokenizer
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

TARGET = tiny_target_config()
N = 24


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return str(write_head(tmp_path_factory.mktemp("head"), eagle_config(TARGET),
                          head_tensors(TARGET, seed=3)))


@pytest.fixture(scope="module")
def runner():
    r = load_runner(TARGET, num_slots=8, max_len=256, backend="sdpa", load_tokenizer=False,
                    prefix_caching=True)
    r.tokenizer = tiny_tokenizer()
    return r


@pytest.fixture(scope="module")
def references(runner):
    return {f"r{i}": p + greedy_reference(runner, p, N) for i, p in enumerate(PROMPTS[:3])}


class Recording(Eagle3Proposer):
    """Records every HeadStep the head is fed; with `oracle`, drafts the reference instead of
    the head's guesses (the head is still fed), so drafts are accepted."""

    def __init__(self, head, oracle=None):
        super().__init__(head)
        self.fed: dict[str, list] = {}
        self.oracle = oracle
        feed = self.drafter.propose

        def record(rids, steps, ks):
            for rid, s in zip(rids, steps):
                self.fed.setdefault(rid, []).append(s)
            return feed(rids, steps, ks)

        self.drafter.propose = record

    def propose(self, rids, ks):
        proposal = super().propose(rids, ks)
        if self.oracle is not None:
            seqs = [self._seqs[r].tokens for r in rids]
            proposal.tokens = [self.oracle[r][len(s):len(s) + k] for r, s, k in zip(rids, seqs, ks)]
            proposal.confidence = [[1.0] * len(t) for t in proposal.tokens]
        return proposal


def generate(runner, head_dir, references, oracle=False, **overrides):
    config = load_config("configs/tiny.yaml", {
        "draft": "eagle3", "eagle3_head": head_dir, "speculation": "fixed",
        "num_speculative_tokens": 3, **overrides})
    head = build_eagle3_proposer(config, TARGET, runner.model.embed.weight.detach()).drafter.head
    proposer = Recording(head, references if oracle else None)
    core = build_local_engine(config, runner=runner, proposer=proposer)
    prompts = {rid: ref[: len(ref) - N] for rid, ref in references.items()}
    out = asyncio.run(collect(core, [(rid, p, SamplingParams(max_new_tokens=N, ignore_eos=True))
                                     for rid, p in prompts.items()]))
    return {rid: prompts[rid] + c.token_ids for rid, c in out.items()}, proposer, core


def check_fed(proposer, references, head_dir):
    """The head got positions 0, 1, 2, ... in order, each with the target's aux states there
    (recomputed over the whole sequence in one forward) and the token after it."""
    layers = head_aux_layers(head_dir, TARGET)
    fresh = load_runner(TARGET, num_slots=1, max_len=256, backend="sdpa", load_tokenizer=False)
    sizes = []
    for rid, full in references.items():
        slot = fresh.allocate()
        _, aux = fresh.forward([slot], [full], aux_layers=layers)
        fresh.free(slot)
        at = 0
        for step in proposer.fed[rid]:
            at = 0 if step.start == 0 else at  # a preempted request prefills again
            assert step.start == at
            n = len(step.next_tokens)
            assert step.next_tokens == full[at + 1:at + 1 + n]
            torch.testing.assert_close(step.aux.float(), aux[at:at + n].to(step.aux.dtype).float(),
                                       rtol=2e-2, atol=2e-2)
            sizes.append(n)
            at += n
        assert at >= len(full) - 4 - 1  # all but the last step's kept positions (never sent)
    return sizes


def test_greedy_eagle3_equals_target_only_and_feeds_the_target_states(runner, head_dir,
                                                                      references):
    got, proposer, core = generate(runner, head_dir, references, max_num_batched_tokens=6)
    assert got == references
    sizes = check_fed(proposer, references, head_dir)
    assert 6 in sizes  # chunked prefill: a chunk's states arrive as one step
    assert core.stats.draft_tokens > 0  # the head drafted (and the target rejected most)


def test_accepted_drafts_send_every_kept_position(runner, head_dir, references):
    got, proposer, core = generate(runner, head_dir, references, oracle=True)
    assert got == references
    sizes = check_fed(proposer, references, head_dir)
    assert 4 in sizes and core.stats.accepted_tokens > 0  # kept 3 drafts + the bonus token
    aux = next(iter(proposer.fed.values()))[0].aux
    row = aux.shape[1] * aux.element_size()
    # every fed position was counted once, plus each request's last kept ones (never fed)
    sent = core.stats.hidden_state_bytes
    assert sum(sizes) * row <= sent <= (sum(sizes) + 4 * len(references)) * row


def test_preempted_requests_rebuild_the_head_from_their_recompute(runner, head_dir,
                                                                  references):
    got, proposer, core = generate(runner, head_dir, references, kv_cache_tokens=64,
                                   max_model_len=64)
    assert core.scheduler.preemptions > 0
    assert got == references
    check_fed(proposer, references, head_dir)
    assert any([s.start for s in steps].count(0) > 1 for steps in proposer.fed.values())


def test_prefix_reuse_is_off_for_eagle3(runner, head_dir):
    prompt = list(range(10, 50))  # two whole KV blocks
    for draft, hits in (("ngram", True), ("eagle3", False)):
        overrides = {"draft": draft, "max_num_seqs": 1}
        config = load_config("configs/tiny.yaml", {"eagle3_head": head_dir, **overrides})
        proposer = None if draft == "ngram" else Recording(
            build_eagle3_proposer(config, TARGET, runner.model.embed.weight.detach()).drafter.head)
        core = build_local_engine(config, runner=runner, proposer=proposer)
        prompts = [(rid, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
                   for rid in ("a", "b")]
        asyncio.run(collect(core, prompts))
        assert (core.stats.prefix_hits > 0) == hits
