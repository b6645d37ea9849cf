"""Property: KV served from the prefix cache equals recomputation, whatever the block size, the
shared prefixes, the drafts and how many of them were rejected (the runner's real KV tensors,
tiny model). Sequences run over one pool, some kept alive while later ones attach, so cached
blocks are shared, evicted and reused; after every sequence its KV rows (read through its block
table) and its next-token logits match a fresh prefill of the same committed tokens on a runner
without caching."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config, tiny_model

MAX_LEN = 96
CONFIG = tiny_config()
MODEL = tiny_model(CONFIG, seed=5)
PREFIXES = [[7] * 60, [7] * 20 + list(range(30, 70)), [5, 6, 9] * 20]


def _runner(block_size: int, caching: bool, tokens: int | None) -> ModelRunner:
    return ModelRunner(MODEL, CONFIG, num_slots=4, max_len=MAX_LEN, backend="sdpa",
                       block_size=block_size, kv_cache_tokens=tokens, prefix_caching=caching)


def _rows(runner: ModelRunner, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's K and V rows, in token order, read through its block table."""
    cache, n, bs = runner.cache, runner.length(slot), runner.cache.block_size
    table = torch.tensor(runner.cache.table(slot))
    pos = torch.arange(n)
    blocks, offs = table[pos // bs], pos % bs
    return cache.k[layer][blocks, offs], cache.v[layer][blocks, offs]


sequences = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 50), st.integers(1, 12),
              st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=4),
              st.booleans()),
    min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 4, 16]), st.sampled_from([None, 192]), sequences,
       st.randoms(use_true_random=False))
def test_cached_kv_equals_recomputation(block_size, pool, seqs, rng):
    torch.set_num_threads(1)
    runner = _runner(block_size, True, pool)
    live: list[int] = []
    hits = 0
    for p, prefix_len, tail, rounds, keep in seqs:
        prompt = PREFIXES[p][:prefix_len] + [rng.randrange(3, 250) for _ in range(tail)]
        if len(live) == runner.num_slots or runner.num_free_blocks() * block_size < MAX_LEN:
            runner.free(live.pop(0))
        slot = runner.allocate()
        cached = runner.attach_prefix(slot, prompt)
        assert cached % block_size == 0 and cached < len(prompt)
        hits += cached
        runner.forward([slot], [prompt[cached:]], last_only=True)
        runner.truncate(slot, runner.length(slot))  # the prompt is committed (as the verifier)
        committed = list(prompt)
        last = rng.randrange(3, 250)
        for k, a in rounds:
            k = min(k, MAX_LEN - len(committed) - 2)
            if k < 0:
                break
            drafts = [rng.randrange(3, 250) for _ in range(k)]
            runner.forward([slot], [[last] + drafts])
            accepted = min(a, k)
            runner.truncate(slot, len(committed) + 1 + accepted)  # rejected drafts dropped
            committed += [last] + drafts[:accepted]
            last = rng.randrange(3, 250)  # the step's bonus token, next in line
        assert runner.cache.tokens[slot] == committed
        ref = _runner(16, False, None)
        rslot = ref.allocate()
        ref.forward([rslot], [committed])
        for layer in range(CONFIG.num_layers):
            for got, want in zip(_rows(runner, slot, layer), _rows(ref, rslot, layer)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        got = runner.forward([slot], [[last]])[0]
        want = ref.forward([rslot], [[last]])[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        runner.truncate(slot, len(committed))
        if keep:
            live.append(slot)
        else:
            runner.free(slot)
        runner.cache.blocks.check()
    for slot in live:
        runner.free(slot)
    blocks = runner.cache.blocks
    blocks.check()
    assert blocks.num_free == blocks.num_blocks and blocks.ref_counts == [0] * blocks.num_blocks
