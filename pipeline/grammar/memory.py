"""A process's compiled grammars under a byte budget (EngineConfig.grammar_memory_mb).

llguidance grows a grammar's memory while it is used: masks build lexer states and regex
derivatives in a store the compiled template and every request's copy share, so a hostile regex
such as `(b{1000}){1000}` holds ~160 MB after one masked step (49k-token vocabulary), for as long
as the template lives. A count-bounded cache (256 templates) is then tens of GB.

So each grammar's size is estimated as the process's RSS growth while it was built and while its
matchers computed masks or checked drafts (`charge`), and at least `BYTES_PER_CHAR` per character
of compiled grammar (60 KB regexes were measured at ~3.9 MB each: ~65 B/char). Requests hold
references (a matcher copy each, released when it is dropped); templates no request uses are kept
in LRU order while the total stays within the budget, and the least recently used go first. A
grammar alone over the budget is refused by the front end before it reaches the engine
(`pipeline.grammar.llg.compile_grammar`). RSS growth is an estimate (allocator reuse, other
threads), but it measures exactly what the budget is about: the process's resident memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 256 << 20
BYTES_PER_CHAR = 64
TRIM_AFTER = 16 << 20  # a measured build that grew this much is trimmed back after
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing: estimates fall back to the
    per-character floor)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and RSS stays up)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Entry:
    template: Any  # the compiled LLMatcher requests copy
    size: int  # estimated bytes
    refs: int = 0  # live matcher copies
    owner: Any = None  # the object whose id() is in the key, kept alive so the id stays its own


class GrammarMemory:
    """Compiled templates keyed by (tokenizer id, grammar text), with sizes and reference counts."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._entries: OrderedDict[tuple[int, str], Entry] = OrderedDict()
        self._lock = threading.Lock()  # the front end compiles in worker threads
        self._compile_lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(e.size for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, key: tuple[int, str], build: Any, owner: Any = None) -> tuple[Any, Entry]:
        """The template for `key` (built by `build()` if absent, its RSS growth charged), with
        one more reference; call `release(entry)` when the copy made from it is dropped."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                before = rss_bytes()
                template = build()
                entry = Entry(template, max(rss_bytes() - before, len(key[1]) * BYTES_PER_CHAR),
                              owner=owner)
                self._entries[key] = entry
            else:
                self._entries.move_to_end(key)
            entry.refs += 1
            self._evict()
            return entry.template, entry

    @contextmanager
    def measuring(self) -> Iterator[list[int]]:
        """Measure a throw-away build (the front end's compile check): yields a one-item list
        that holds the RSS growth once the block ends; builds measured one at a time, so the
        growth is theirs; freed heap handed back to the OS after a large one."""
        grown = [0]
        with self._compile_lock:
            before = rss_bytes()
            try:
                yield grown
            finally:
                grown[0] = max(0, rss_bytes() - before)
        if grown[0] >= TRIM_AFTER:
            _trim()

    def release(self, entry: Entry) -> None:
        with self._lock:
            entry.refs -= 1
            self._evict()

    def charge(self, entry: Entry, grown: int) -> None:
        """A matcher of `entry` grew the process by `grown` bytes (masks, draft checks)."""
        if grown > 0:
            with self._lock:
                entry.size += grown
                self._evict()

    def _evict(self) -> None:
        """Drop unreferenced templates, least recently used first, until within the budget."""
        freed = 0
        if self.total <= self.budget:
            return
        for key in [k for k, e in self._entries.items() if e.refs <= 0]:
            if self.total <= self.budget:
                break
            freed += self._entries.pop(key).size
        if freed:
            _trim()
        if self.total > self.budget:
            log.debug("grammars in use hold %d MB, over the %d MB budget",
                      self.total >> 20, self.budget >> 20)


MEMORY = GrammarMemory()


def set_memory_budget(budget_bytes: int) -> None:
    """This process's grammar budget (EngineConfig.grammar_memory_mb, applied by every process
    that compiles or matches grammars)."""
    if budget_bytes <= 0:
        raise ValueError(f"grammar_memory_mb: must be positive, got {budget_bytes >> 20}")
    MEMORY.budget = budget_bytes
    with MEMORY._lock:
        MEMORY._evict()
