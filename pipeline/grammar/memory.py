"""A process's compiled grammars under a byte budget (`grammar_memory_mb`), not a count:
llguidance grows a grammar's memory while it is used (a hostile regex can hold ~160 MB after one
masked step). A grammar's size is the RSS growth while it was built and used; unheld templates
are evicted least recently used first."""

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
TRIM_AFTER = 16 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """0 where /proc is missing: estimates fall back to the per-character floor."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them, and RSS stays up)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Entry:
    template: Any
    size: int
    refs: int = 0
    owner: Any = None  # the object whose id() is in the key, kept alive so the id stays its own


class GrammarMemory:
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
        """One more reference on `key`'s template; `release(entry)` when its copy is dropped."""
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
        """A throw-away build's RSS growth, one build at a time so the growth is its own."""
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
        if grown > 0:
            with self._lock:
                entry.size += grown
                self._evict()

    def _evict(self) -> None:
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
    if budget_bytes <= 0:
        raise ValueError(f"grammar_memory_mb: must be positive, got {budget_bytes >> 20}")
    MEMORY.budget = budget_bytes
    with MEMORY._lock:
        MEMORY._evict()
