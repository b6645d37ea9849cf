"""Fair admission: the waiting queue grouped by client request, and who gets the next free slot.

A group is one client request (an HTTP request's choices share its id; a request without a
group is its own). Everything is counted in choices: one queue place and one slot each. With a
paged KV cache a choice also needs KV blocks (`blocks_of`), and the free blocks are the real
limit: admission stops at the first choice (in the order below) whose blocks do not fit.

Rules, applied for every free slot:
- the group holding the fewest slots goes first; ties go to the group served least recently
  (never served first), then to the one whose oldest waiting choice arrived first: round robin
  over requests, so one with many choices cannot starve the others;
- the last `reserved_slots` free slots go only to a lone request (a group holding no slot with
  one choice waiting), so a newcomer never waits for a whole generation behind fan-outs that
  filled the other slots (a second fan-out arriving would otherwise take the reserve first);
  counted in blocks too: a choice of a group that is not lone is admitted only if, after it,
  `reserved_slots` more choices of its size still fit in the free blocks.
Within a group choices are admitted in arrival order; a preempted choice goes back to the front
of its group (`push_front`), keeping its arrival order. With a step token budget (chunked
prefill) admission also stops once the admitted prompts' first chunks have used it up: each
choice takes min(what is left, its prompt), so only the last one admitted may be cut.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol


class Waiting(Protocol):
    rid: str
    group: str
    seq: int  # arrival order


class FairQueue:
    """Waiting requests by group; `admit` picks which of them take the free slots."""

    def __init__(self, reserved_slots: int = 0) -> None:
        self.reserved_slots = reserved_slots
        self._groups: dict[str, deque[Waiting]] = {}
        self._where: dict[str, str] = {}  # rid -> group
        self._served: dict[str, int] = {}  # group -> when it last got a slot (admission count)
        self._seq = 0
        self._admissions = 0

    def push(self, req: Waiting) -> None:
        req.seq = self._seq
        self._seq += 1
        self._groups.setdefault(req.group, deque()).append(req)
        self._where[req.rid] = req.group

    def push_front(self, req: Waiting) -> None:
        """Requeue a preempted request ahead of its group, with its original arrival order."""
        self._groups.setdefault(req.group, deque()).appendleft(req)
        self._where[req.rid] = req.group

    def remove(self, rid: str) -> Waiting | None:
        group = self._where.pop(rid, None)
        if group is None:
            return None
        queue = self._groups[group]
        req = next(r for r in queue if r.rid == rid)
        queue.remove(req)
        if not queue:
            self._drop(group)
        return req

    def _drop(self, group: str) -> None:
        del self._groups[group]
        self._served.pop(group, None)

    def _order(self, group: str, held: Counter[str]) -> tuple[int, int, int]:
        return held[group], self._served.get(group, -1), self._groups[group][0].seq

    def admit(self, free_slots: int, held: Counter[str], free_blocks: int | None = None,
              blocks_of: Callable[[Waiting], int] | None = None, tokens: int | None = None,
              tokens_of: Callable[[Waiting], int] | None = None) -> list[Waiting]:
        """Pop the requests that take (some of) `free_slots`, given the slots each group holds
        now (`held` is updated as slots are handed out). With `free_blocks`, each admitted
        request also takes `blocks_of(request)` of them; with `tokens` (a step's prompt budget),
        min(what is left, `tokens_of(request)`) of those, and none is admitted once it is 0."""
        out: list[Waiting] = []
        while free_slots > 0 and self._groups and (tokens is None or tokens > 0):
            groups: Iterable[str] = self._groups
            reserve = free_slots <= self.reserved_slots
            if free_blocks is not None and blocks_of is not None and self.reserved_slots:
                head = self._groups[min(groups, key=lambda g: self._order(g, held))][0]
                cost = blocks_of(head)
                reserve = reserve or free_blocks - cost < self.reserved_slots * cost
            if reserve:
                groups = [g for g in self._groups if held[g] == 0 and len(self._groups[g]) == 1]
                if not groups:
                    break  # keep the reserve for a lone request
            group = min(groups, key=lambda g: self._order(g, held))
            cost = 0
            if free_blocks is not None and blocks_of is not None:
                cost = blocks_of(self._groups[group][0])
                if cost > free_blocks:
                    break  # the next in fair order waits for blocks; nobody jumps it
            req = self._groups[group].popleft()
            self._served[group] = self._admissions
            self._admissions += 1
            if not self._groups[group]:
                self._drop(group)
            del self._where[req.rid]
            held[group] += 1
            free_slots -= 1
            if free_blocks is not None:
                free_blocks -= cost
            if tokens is not None and tokens_of is not None:
                tokens -= min(tokens, tokens_of(req))
            out.append(req)
        return out

    def count(self, group: str) -> int:
        """Choices of `group` waiting."""
        return len(self._groups.get(group, ()))

    def __contains__(self, rid: str) -> bool:
        return rid in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Waiting]:
        """In arrival order."""
        return iter(sorted((r for q in self._groups.values() for r in q), key=lambda r: r.seq))
