"""Which stage actors a failed engine replaces: those that do not answer a `reset` in time, and
every verifier rank if one does not (one lost rank breaks their process group)."""

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
    draft: bool
    verifiers: bool
    output: bool

    @property
    def everything(self) -> bool:
        return self.draft and self.verifiers and self.output

    def describe(self) -> str:
        names = [n for n, r in (("draft", self.draft), ("verifier ranks", self.verifiers),
                                ("output", self.output)) if r]
        return ", ".join(names) or "nothing"


async def answered(calls: list[Awaitable[Any]], timeout_s: float) -> bool:
    # False as soon as one fails: a dead rank's peers may be stuck in a collective
    if not calls:
        return True
    tasks = [asyncio.ensure_future(c) for c in calls]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s,
                                       return_when=asyncio.FIRST_EXCEPTION)
    for task in pending:
        task.cancel()
    failed = False
    for task in done:  # retrieve every exception: no "never retrieved" warnings
        failed |= task.exception() is not None
    for task in pending:
        with contextlib.suppress(BaseException):
            await task
    return not failed and not pending


async def stages_to_replace(draft: Awaitable[Any] | None, ranks: list[Awaitable[Any]],
                            output: Awaitable[Any], timeout_s: float) -> Replace:
    draft_ok, ranks_ok, output_ok = await asyncio.gather(
        answered([draft], timeout_s) if draft is not None else _false(),
        answered(ranks, timeout_s), answered([output], timeout_s))
    return Replace(draft=not draft_ok, verifiers=not ranks_ok, output=not output_ok)


async def _false() -> bool:
    return False


async def until_built(attempt: Callable[[], Awaitable[None]], report: Callable[[str], None],
                      first_pause_s: float = 1.0, max_pause_s: float = 30.0) -> int:
    """Await `attempt()` until it returns, with a doubling pause; returns how many failed."""
    failed, pause = 0, first_pause_s
    while True:
        try:
            await attempt()
            return failed
        except Exception as e:
            failed += 1
            what = (f"rebuild attempt {failed} failed ({type(e).__name__}: {str(e)[:200]}); "
                    f"trying again in {pause:.0f}s")
            log.warning("engine %s", what, exc_info=True)
            report(what)
            await asyncio.sleep(pause)
            pause = min(pause * 2, max_pause_s)
