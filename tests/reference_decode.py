"""Plain target-only greedy decoding, one token per forward: the yardstick speculative output is
compared against (tests, benchmarks). Deliberately shares no code with the engine loop."""

from __future__ import annotations

from pipeline.models.runner import ModelRunner


def greedy_reference(runner: ModelRunner, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """The first `num_tokens` greedy tokens after `prompt_ids` (no stop rules)."""
    slot = runner.allocate()
    try:
        logits = runner.forward([slot], [list(prompt_ids)], last_only=True)[0]
        out = [int(logits[-1].argmax())]
        while len(out) < num_tokens:
            logits = runner.forward([slot], [[out[-1]]])[0]
            out.append(int(logits[-1].argmax()))
        return out
    finally:
        runner.free(slot)
