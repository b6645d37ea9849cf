"""Suffix drafting: the bounded token index (longest-suffix match, counts, eviction) and the
proposer over it (per-request + global index, greedy output unchanged through the engine)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.reference_decode import greedy_reference

from pipeline.config import load_config
from pipeline.draft.base import Proposal
from pipeline.draft.step import build_proposer, draft_step, keep_confident
from pipeline.draft.suffix import SuffixProposer, SuffixSettings
from pipeline.draft.suffix_index import TokenIndex
from pipeline.engine.local import build_local_engine, collect
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol import StepPlan

GREEDY = SamplingParams()


def own_tail(index: TokenIndex, n: int = 32) -> np.ndarray:
    return index.tokens(index.end - n, index.end)


# --- the index ------------------------------------------------------------------------------
def test_longest_suffix_wins_over_a_newer_shorter_match():
    ix = TokenIndex(100, max_depth=8)
    ix.extend([1, 2, 3, 40, 41, 9, 2, 3, 50, 1, 2, 3])
    m = ix.match(own_tail(ix), 4, spec_factor=4, exclude_last=True)
    # "1 2 3" occurred once before (followed by 40 41); "2 3" alone more recently (then 50)
    assert m.match_len == 3 and m.occurrences == 1
    assert m.tokens == [40, 41, 9, 2] and m.confidence == [1.0] * 4


def test_confidence_is_agreeing_continuations_over_context_occurrences():
    ix = TokenIndex(100, max_depth=4)
    for tail in ([7, 8], [7, 8], [7, 9], [6, 6]):
        ix.extend([1, 2, *tail])
        ix.end_run()
    m = ix.match(np.array([1, 2]), 4, spec_factor=2)
    assert m.occurrences == 4
    assert m.tokens == [7, 8] and m.confidence == [0.75, 0.5]
    # below the threshold the draft stops
    assert ix.match(np.array([1, 2]), 4, min_score=0.6, spec_factor=2).tokens == [7]


def test_draft_length_follows_match_length_and_k():
    ix = TokenIndex(100, max_depth=8)
    ix.extend(list(range(10, 30)))
    ix.end_run()
    assert ix.match(np.array([12]), 10).tokens == [13]  # 1 matched token earns 1 draft
    assert ix.match(np.array([10, 11, 12]), 10).tokens == [13, 14, 15]
    assert ix.match(np.array([10, 11, 12]), 2, spec_factor=9).tokens == [13, 14]
    assert ix.match(np.array([10, 11, 12]), 0).tokens == []


def test_continuations_stop_at_a_run_separator():
    ix = TokenIndex(100, max_depth=8)
    ix.extend([5, 6, 7])
    ix.end_run()
    ix.extend([8, 9])
    m = ix.match(np.array([5, 6]), 10, spec_factor=9)
    assert m.tokens == [7]
    assert ix.match(np.array([7]), 10).tokens == []  # 7 ended its run: nothing follows it


def test_no_match_drafts_nothing():
    ix = TokenIndex(100)
    ix.extend([1, 2, 3])
    assert ix.match(np.array([4]), 5).tokens == []
    assert TokenIndex(10).match(np.array([1]), 5).tokens == []


def test_token_capacity_evicts_the_oldest_tokens():
    ix = TokenIndex(capacity=64, max_depth=8)
    ix.extend([1, 2, 3, 4])
    ix.end_run()
    assert ix.match(np.array([1, 2]), 2, spec_factor=9).tokens == [3, 4]
    ix.extend([100] * 70)  # pushes the first run out
    assert len(ix) == 64
    assert ix.match(np.array([1, 2]), 2, spec_factor=9).tokens == []


def test_run_limit_evicts_whole_runs():
    ix = TokenIndex(capacity=1000, max_depth=8, max_runs=2)
    for r in range(5):
        ix.extend([1, 2, 10 + r])
        ix.end_run()
    assert ix.num_runs == 2 and len(ix) == 8  # two runs of 3 tokens + separator
    m = ix.match(np.array([1, 2]), 1, spec_factor=2)
    assert m.occurrences == 2 and m.tokens == [14]  # a tie goes to the newest


@settings(max_examples=60, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=2, max_size=60),
       ctx=st.lists(st.integers(0, 3), min_size=1, max_size=6),
       chunk=st.integers(1, 60))
def test_match_agrees_with_a_brute_force_scan(seq, ctx, chunk):
    """Small alphabet, few tokens: every occurrence is a candidate, so the index must find the
    same longest match, occurrence count and first draft token as a scan of the sequence,
    whether it was written in decode-sized chunks (linked in Python) or long ones (numpy)."""
    ix = TokenIndex(capacity=128, max_depth=6, max_candidates=128)
    for at in range(0, len(seq), chunk):
        ix.extend(seq[at:at + chunk])
    m = ix.match(np.array(ctx), 1, spec_factor=1)

    def matched(end: int) -> int:
        n = 0
        while n < len(ctx) and end - n >= 0 and seq[end - n] == ctx[-1 - n]:
            n += 1
        return n

    lens = [matched(e) for e in range(len(seq))]
    best = max(lens)
    assert m.match_len == best
    if best == 0:
        assert m.tokens == []
        return
    occ = [e for e in range(len(seq)) if lens[e] == best]
    assert m.occurrences == len(occ)
    nexts = [seq[e + 1] for e in occ if e + 1 < len(seq)]
    if not nexts:
        assert m.tokens == []
        return
    top = max(nexts.count(t) for t in set(nexts))
    assert m.confidence == [top / len(occ)]
    assert nexts.count(m.tokens[0]) == top


def test_global_index_stays_within_its_size_over_10000_requests():
    p = SuffixProposer(SuffixSettings(max_depth=8, global_requests=500, global_tokens=4096,
                                      max_model_len=128))
    rng = np.random.default_rng(0)
    full = TokenIndex(4096, max_depth=8).nbytes  # allocated at capacity
    assert p.global_index.nbytes < full  # a new index starts small
    for i in range(10_000):
        rid = f"r{i}"
        p.add(rid, rng.integers(0, 1000, 8).tolist(), GREEDY)
        p.commit(rid, rng.integers(0, 1000, int(rng.integers(1, 20))).tolist())
        p.remove(rid)
        assert len(p.global_index) <= 4096 and p.global_index.num_runs <= 500
        assert p.global_index.nbytes <= full  # grown up to capacity, never past it
    assert p.global_index.nbytes == full
    assert p._seqs == {}


# --- the proposer ---------------------------------------------------------------------------
def test_proposer_copies_from_its_own_prompt_and_reports_confidence():
    p = SuffixProposer(SuffixSettings(max_model_len=64, spec_factor=4))
    p.add("a", [10, 11, 12, 13, 14, 15, 10, 11], GREEDY)
    out = p.propose(["a"], [4])
    assert out.tokens == [[12, 13, 14, 15]] and out.confidence == [[1.0] * 4]
    p.commit("a", [12, 99])
    assert p.propose(["a"], [4]).tokens == [[]]  # "99" never occurred before
    assert p.propose(["a"], [0]).tokens == [[]]


def test_finished_output_drafts_for_the_next_request_with_the_same_prompt_end():
    p = SuffixProposer(SuffixSettings(max_model_len=64, spec_factor=8))
    p.add("a", [1, 2, 3], GREEDY)
    p.commit("a", [50, 51, 52, 53])
    assert p.propose(["a"], [4]).tokens == [[]]  # nothing repeats yet
    p.remove("a")  # released: its output enters the global index
    p.add("b", [7, 2, 3], GREEDY)
    assert p.propose(["b"], [4]).tokens == [[50, 51, 52, 53]]
    p.remove("b")  # nothing generated: not indexed
    assert p.global_index.num_runs == 1


def test_a_finished_requests_last_step_enters_the_global_index():
    p = SuffixProposer(SuffixSettings(max_model_len=64, spec_factor=8))
    p.add("a", [1, 2, 3], GREEDY)
    p.commit("a", [50, 51])
    p.finish("a", [52, 53])  # its last step: released with the tokens it never committed
    p.add("b", [7, 2, 3], GREEDY)
    assert p.propose(["b"], [8]).tokens == [[50, 51, 52, 53]]


def test_build_proposer_reads_the_suffix_config():
    config = load_config("configs/tiny.yaml", {"draft": "suffix", "suffix_global_requests": 7,
                                               "suffix_min_score": 0.25})
    p = build_proposer(config)
    assert isinstance(p, SuffixProposer)
    assert p.global_index.max_runs == 7 and p.settings.min_score == 0.25


@pytest.mark.parametrize(("field", "value"), [
    ("suffix_min_score", 1.5), ("suffix_min_score", "high"), ("suffix_global_tokens", 10),
    ("suffix_global_requests", 0), ("suffix_spec_factor", 0), ("suffix_max_depth", True)])
def test_bad_suffix_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        load_config("configs/tiny.yaml", {"draft": "suffix", field: value})


# --- through the engine -----------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 101], [3] * 20, [30, 31, 32, 33, 30, 31]]


def suffix_engine(speculation: str):
    """An in-process suffix engine (up to 16 drafts) on the tiny model, and each prompt's
    target-only greedy reference."""
    config = load_config("configs/tiny.yaml", {"draft": "suffix", "speculation": speculation,
                                               "num_speculative_tokens": 16})
    runner = build_runner(config.replace(draft="none"))
    refs = [greedy_reference(runner, p, 30) for p in PROMPTS]
    return build_local_engine(config, runner), refs


def wave(core, tag: str) -> list[list[int]]:
    """Every prompt once (30 tokens, EOS ignored): the output token ids, in prompt order."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    out = asyncio.run(collect(core, [(f"{tag}{i}", p, params) for i, p in enumerate(PROMPTS)]))
    return [out[f"{tag}{i}"].token_ids for i in range(len(PROMPTS))]


def test_suffix_engine_greedy_equals_target_only_and_drafts_from_finished_requests(
        one_torch_thread):
    # fixed: every step may take 16 drafts, so what is accepted depends on the index only
    # (adaptive k follows measured step times)
    core, refs = suffix_engine("fixed")
    assert wave(core, "a") == refs
    # every whole output is indexed, its last step too (it is never committed, only released):
    # the prompt's last tokens, 30 output tokens and a separator per request
    assert len(core.stages.proposer.global_index) == sum(min(len(p), 32) + 30 + 1
                                                         for p in PROMPTS)
    accepted_first = core.stats.accepted_tokens
    assert wave(core, "b") == refs
    # the second wave repeats the first wave's outputs, which the global index now holds
    assert core.stats.accepted_tokens - accepted_first > 2 * len(PROMPTS) * 10


# --- the draft stage under adaptive speculation -----------------------------------------------
def test_the_draft_stage_drafts_up_to_the_caps_and_keeps_drafts_above_the_floor():
    p = SuffixProposer(SuffixSettings(max_model_len=64, spec_factor=8))
    # in the global index twice: 1 2 3 -> 4 5 6 7 8 9, once: 1 2 3 -> 4 5 0
    for rid, output in (("a", [4, 5, 6, 7, 8, 9]), ("b", [4, 5, 6, 7, 8, 9]), ("c", [4, 5, 0])):
        p.add(rid, [1, 2, 3], GREEDY)
        p.commit(rid, output)
        p.remove(rid)
    p.add("d", [1, 2, 3], GREEDY)
    plan = StepPlan(step=0, decode=["d"], ks=[1], caps=[8], min_gains=[0.7])
    proposal = draft_step(p, plan)
    # the controller's k (1) does not limit a scored draft; the floor does: 4 and 5 follow
    # 1 2 3 every time (1.0), 6 two times in three
    assert proposal.tokens == [[4, 5]] and proposal.confidence == [[1.0, 1.0]]
    plan = StepPlan(step=1, decode=["d"], ks=[1], caps=[8], min_gains=[0.5])
    assert draft_step(p, plan).tokens == [[4, 5, 6, 7, 8, 9]]
    # a floor no confidence reaches: the proposer is not even asked
    asked = []
    real = p.propose
    p.propose = lambda rids, ks: asked.append(ks) or real(rids, ks)
    plan = StepPlan(step=2, decode=["d"], ks=[1], caps=[8], min_gains=[1.5])
    assert draft_step(p, plan).tokens == [[]] and asked == [[0]]
    assert keep_confident(Proposal([[1, 2, 3]], confidence=[[0.9, 0.6, 0.3]]), [0.6]) == [[1, 2]]
    assert keep_confident(Proposal([[1, 2, 3]], confidence=[[0.9, 0.6, 0.3]]), [0.0]) == [[1, 2, 3]]


def test_adaptive_suffix_engine_is_lossless_and_calibrates_on_the_verified_confidence(
        one_torch_thread):
    core, refs = suffix_engine("adaptive")
    for tag in "abc":
        assert wave(core, tag) == refs
    spec = core.scheduler.spec
    assert core.stats.accepted_tokens > 0 and spec.pool.expected > 0  # scored drafts verified
    assert 0 < spec.pool.accepted <= spec.pool.expected * 1.5
    assert spec.tracked == 0  # finished requests leave no state


# --- tenants ----------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 5), min_size=1, max_size=300), st.integers(1, 40))
def test_a_growing_index_matches_like_a_preallocated_one(seq, every):
    grown, full = TokenIndex(256, max_depth=6, initial=2), TokenIndex(256, max_depth=6)
    for i in range(0, len(seq), every):
        for ix in (grown, full):
            ix.extend(seq[i:i + every])
            if i % 3 == 0:
                ix.end_run()
        ctx = np.array(seq[max(0, i - 5): i + every])
        a, b = grown.match(ctx, 8), full.match(ctx, 8)
        assert (a.tokens, a.confidence, a.match_len) == (b.tokens, b.confidence, b.match_len)
    assert len(grown) == len(full) and grown.nbytes <= full.nbytes


def _bytes(text: str) -> list[int]:
    return list(text.encode())


SECRET = "x7Kq9"
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _oracle(share: bool, victim_sends: bool) -> tuple[str, list[list[int]]]:
    """Issue 42's attack at the proposer: tenant A sends prompts holding a secret (max_tokens 1:
    the secret is never output); tenant B forces each candidate next character into its context
    and reads how many drafts it gets. Returns what B recovers and its score rows."""
    p = SuffixProposer(SuffixSettings(max_model_len=256, share_across_tenants=share))
    if victim_sends:
        for i in range(3):
            rid = f"a{i}"
            p.add(rid, _bytes(f"note {i}: the vault code is {SECRET}; keep it"), GREEDY, "A")
            p.finish(rid, _bytes("\n"))
    known, rows = "", []
    for _ in SECRET:
        scores = []
        for c in ALPHABET:
            p.add("b", _bytes(f"the vault code is {known}{c}"), GREEDY, "B")
            scores.append(len(p.propose(["b"], [16]).tokens[0]))
            p.remove("b")  # nothing generated: B's probes index nothing
        rows.append(scores)
        best = max(scores)
        if scores.count(best) > 1:
            break  # no candidate stands out: nothing learnt
        known += ALPHABET[scores.index(best)]
    return known, rows


def test_a_tenant_cannot_read_another_tenants_prompts_through_its_drafts():
    recovered, rows = _oracle(share=False, victim_sends=True)
    # B's scores are exactly those of a world where A never sent anything (what varies across
    # candidates comes from B's own probe text), so they say nothing of the secret
    assert _oracle(share=False, victim_sends=False) == (recovered, rows)
    assert not recovered.startswith(SECRET[0])
    shared, _ = _oracle(share=True, victim_sends=False)
    assert shared == recovered  # sharing changes nothing while A is silent


def test_with_a_shared_index_the_oracle_recovers_the_secret():
    # the documented trade-off of suffix_share_across_tenants
    recovered, _ = _oracle(share=True, victim_sends=True)
    assert recovered == SECRET


def test_tenant_indexes_share_a_token_budget_and_drop_the_least_recent_whole():
    p = SuffixProposer(SuffixSettings(max_depth=4, max_model_len=64, global_tokens=100,
                                      max_tenants=3))
    for i, tenant in enumerate(["t0", "t1", "t2", "t3", "t1"]):
        p.add(f"r{i}", [1, 2, 3, 4], GREEDY, tenant)
        p.finish(f"r{i}", list(range(10, 40)))
    assert p.num_tenants == 3 and sum(len(ix) for ix in p._shared.values()) <= 100
    assert list(p._shared) == ["t2", "t3", "t1"]  # t0 went first (least recently used)


def test_build_proposer_reads_the_tenant_config():
    config = load_config("configs/tiny.yaml", {"draft": "suffix", "suffix_max_tenants": 5,
                                               "suffix_share_across_tenants": True})
    p = build_proposer(config)
    assert p.settings.max_tenants == 5 and p.settings.share_across_tenants
    with pytest.raises(ValueError, match="suffix_share_across_tenants"):
        load_config("configs/tiny.yaml", {"suffix_share_across_tenants": "yes"})
