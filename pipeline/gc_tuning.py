"""Garbage-collector settings for the long-running processes on the per-step path (the output and
engine actors).

Each step allocates thousands of short-lived containers (top-logprob pairs, deltas, id lists).
With CPython's default gen-0 threshold (700 net allocations) the collector runs several times per
step and each pass also scans what the step still holds; on `scripts/bench_output.py`'s text path
(256 requests x 5 tokens, top-5, 2 stop strings) that was about half of the output processor's
time. A larger gen-0 threshold makes those passes rare (a few MB of garbage more at most), and
`gc.freeze()` keeps the start-up objects (tokenizer, modules) out of every later full scan, as
vLLM and SGLang do after loading.
"""

from __future__ import annotations

import gc

DEFAULT_GEN0_THRESHOLD = 20_000


def tune_gc(gen0_threshold: int | None = DEFAULT_GEN0_THRESHOLD) -> None:
    """Freeze what start-up left alive and raise the gen-0 threshold (None: leave CPython's
    defaults alone). Call once, after the process has loaded what it keeps."""
    if gen0_threshold is None:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
