"""Fair admission: the waiting queue grouped by client request (a group; counted in choices),
and who takes each free slot: the group holding the fewest slots, then the one served least
recently, then the oldest. The last `reserved_slots` slots (and, with a KV pool, room for that
many more choices of the head's size) go only to a lone request, so fan-outs cannot make a
newcomer wait a whole generation. Nobody jumps a head that waits for blocks; a preempted choice
goes back to the front of its group. A step token budget stops admission once it is spent."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol


class Waiting(Protocol):
    rid: str
    group: str
    seq: int


class FairQueue:
    def __init__(self, reserved_slots: int = 0) -> None:
        self.reserved_slots = reserved_slots
        self._groups: dict[str, deque[Waiting]] = {}
        self._where: dict[str, str] = {}
        self._served: dict[str, int] = {}  # group -> admission count when it last got a slot
        self._seq = 0
        self._admissions = 0

    def push(self, req: Waiting) -> None:
        req.seq = self._seq
        self._seq += 1
        self._groups.setdefault(req.group, deque()).append(req)
        self._where[req.rid] = req.group

    def push_front(self, req: Waiting) -> None:
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
        """Pop who takes the free slots; `held` (slots per group) is updated."""
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
                    break
            group = min(groups, key=lambda g: self._order(g, held))
            cost = 0
            if free_blocks is not None and blocks_of is not None:
                cost = blocks_of(self._groups[group][0])
                if cost > free_blocks:
                    break
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
        return len(self._groups.get(group, ()))

    def __contains__(self, rid: str) -> bool:
        return rid in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Waiting]:
        return iter(sorted((r for q in self._groups.values() for r in q), key=lambda r: r.seq))
