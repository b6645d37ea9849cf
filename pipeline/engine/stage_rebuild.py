"""Which stage actors a failed engine replaces: only those that do not answer a reset.

A verifier rank or the output actor dying (or wedging) fails every request in flight (their KV
slots or output state are gone), and the engine starts a new EngineCore with an empty scheduler.
The stages that survived are kept: each is asked to `reset` (forget every request it knows, so
no state leaks and the ids may come back), and one that answers within the bound is kept as it
is (model loaded, prefix cache warm). The verifier ranks go together: under tensor parallelism
their process group is broken when one rank is gone, so one failed rank replaces every rank.
A draft stage that is itself being replaced (lost before the failure) is replaced too.
A rebuild that fails (a replacement dies while it loads: its node was lost before the cluster
noticed) is tried again after a growing pause, until one succeeds (`until_built`).

The transport (actors.stage_actors) sends the resets and starts the replacements. No Ray here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Replace:
    """Which stages a rebuild starts anew (the others are kept, reset)."""

    draft: bool
    verifiers: bool  # every rank, or none
    output: bool

    @property
    def everything(self) -> bool:
        return self.draft and self.verifiers and self.output

    def describe(self) -> str:
        """In words, for the rebuild's phase in health()."""
        names = [n for n, r in (("draft", self.draft), ("verifier ranks", self.verifiers),
                                ("output", self.output)) if r]
        return ", ".join(names) or "nothing"


async def answered(calls: list[Awaitable[Any]], timeout_s: float) -> bool:
    """Whether every call completes without an error within `timeout_s`; False as soon as one
    fails (a dead rank's error comes at once, while its peers may be stuck in a collective)."""
    if not calls:
        return True
    tasks = [asyncio.ensure_future(c) for c in calls]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s,
                                       return_when=asyncio.FIRST_EXCEPTION)
    for task in pending:
        task.cancel()
    failed = False
    for task in done:  # every exception is retrieved (no "never retrieved" warnings)
        failed |= task.exception() is not None
    for task in pending:
        with contextlib.suppress(BaseException):
            await task
    return not failed and not pending


async def stages_to_replace(draft: Awaitable[Any] | None, ranks: list[Awaitable[Any]],
                            output: Awaitable[Any], timeout_s: float) -> Replace:
    """Reset the stages at once (`draft`, each of `ranks`, `output`: their reset calls; `draft`
    None: the draft stage is not live, so it is replaced) and say which to replace: every one
    that did not answer within `timeout_s`, and every rank when any rank did not."""
    draft_ok, ranks_ok, output_ok = await asyncio.gather(
        answered([draft], timeout_s) if draft is not None else _false(),
        answered(ranks, timeout_s), answered([output], timeout_s))
    return Replace(draft=not draft_ok, verifiers=not ranks_ok, output=not output_ok)


async def _false() -> bool:
    return False


async def until_built(attempt: Callable[[], Awaitable[None]], report: Callable[[str], None],
                      first_pause_s: float = 1.0, max_pause_s: float = 30.0) -> int:
    """Await `attempt()` until it returns; after each failure `report` it (health() shows why
    the engine is still down) and pause, twice as long each time up to `max_pause_s`. Returns
    how many attempts failed. A cancelled attempt (the engine shuts down) ends the loop."""
    failed, pause = 0, first_pause_s
    while True:
        try:
            await attempt()
            return failed
        except Exception as e:  # whatever it was, the next attempt starts clean
            failed += 1
            what = (f"rebuild attempt {failed} failed ({type(e).__name__}: {str(e)[:200]}); "
                    f"trying again in {pause:.0f}s")
            log.warning("engine %s", what, exc_info=True)
            report(what)
            await asyncio.sleep(pause)
            pause = min(pause * 2, max_pause_s)
