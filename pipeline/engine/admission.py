"""Fair admission: the waiting queue grouped by client request, and who gets the next free slot.

A group is one client request (an HTTP request's choices share its id; a request without a
group is its own). Everything is counted in choices: one queue place and one slot each.

Rules, applied for every free slot:
- the group holding the fewest slots goes first; ties go to the group served least recently
  (never served first), then to the one whose oldest waiting choice arrived first: round robin
  over requests, so one with many choices cannot starve the others;
- the last `reserved_slots` free slots go only to a lone request (a group holding no slot with
  one choice waiting), so a newcomer never waits for a whole generation behind fan-outs that
  filled the other slots (a second fan-out arriving would otherwise take the reserve first).
Within a group choices are admitted in arrival order.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator
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

    def admit(self, free_slots: int, held: Counter[str]) -> list[Waiting]:
        """Pop the requests that take (some of) `free_slots`, given the slots each group holds
        now (`held` is updated as slots are handed out)."""
        out: list[Waiting] = []
        while free_slots > 0 and self._groups:
            groups: Iterable[str] = self._groups
            if free_slots <= self.reserved_slots:
                groups = [g for g in self._groups if held[g] == 0 and len(self._groups[g]) == 1]
                if not groups:
                    break  # keep the reserve for a lone request
            group = min(groups, key=lambda g: self._order(g, held))
            req = self._groups[group].popleft()
            self._served[group] = self._admissions
            self._admissions += 1
            if not self._groups[group]:
                self._drop(group)
            del self._where[req.rid]
            held[group] += 1
            free_slots -= 1
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
