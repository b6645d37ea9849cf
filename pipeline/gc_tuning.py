"""GC settings for the per-step processes (engine and output actors): each step makes thousands of
short-lived containers, and at CPython's gen-0 threshold of 700 collection took about half of the
output processor's time."""

from __future__ import annotations

import gc

DEFAULT_GEN0_THRESHOLD = 20_000


def tune_gc(gen0_threshold: int | None = DEFAULT_GEN0_THRESHOLD) -> None:
    """Call once, after start-up: frozen objects stay out of every later full scan."""
    if gen0_threshold is None:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
