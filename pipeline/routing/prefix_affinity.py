"""Prefix affinity: send a prompt to the replica holding the KV of its longest prefix, unless loads
differ too much. Prefixes are whole blocks under the prefix cache's chained keys, not text (Ray's
PrefixCacheAffinityRouter): a character prefix does not line up with KV blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from pipeline.block_hash import block_keys

__all__ = ["DEFAULT_MAX_BLOCKS", "PrefixAffinity", "block_keys"]

DEFAULT_MAX_BLOCKS = 1 << 17  # ~2M prompt tokens at 16 a block


class PrefixAffinity:
    """Which replicas were sent which prompt blocks: a bounded LRU of block keys."""

    def __init__(self, block_size: int = 16, imbalance_threshold: int = 8,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if imbalance_threshold < 0:
            raise ValueError("imbalance_threshold: must be an integer >= 0")
        if max_blocks < 1:
            raise ValueError("max_blocks: must be an integer >= 1")
        self.block_size = block_size
        self.imbalance_threshold = imbalance_threshold
        self.max_blocks = max_blocks
        self._holders: OrderedDict[bytes, set[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        return block_keys(prompt_ids, self.block_size)

    def matched_blocks(self, keys: Sequence[bytes], candidates: Iterable[Hashable],
                       ) -> dict[Hashable, int]:
        out = {r: 0 for r in candidates}
        alive = set(out)
        for depth, key in enumerate(keys, 1):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for r in alive:
                out[r] = depth
        return out

    def choose(self, keys: Sequence[bytes], queue_lens: Mapping[Hashable, int]) -> Hashable | None:
        """The candidate holding the longest prefix, the least loaded among equals; None when
        none holds a block or loads differ by more than `imbalance_threshold`."""
        if not queue_lens or not keys:
            return None
        loads = queue_lens.values()
        if max(loads) - min(loads) > self.imbalance_threshold:
            return None
        matched = self.matched_blocks(keys, queue_lens)
        best = max(matched.values())
        if best == 0:
            return None
        return min((r for r, m in matched.items() if m == best),
                   key=lambda r: (queue_lens[r], str(r)))

    def record(self, replica: Hashable, keys: Sequence[bytes]) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = set()
            else:
                self._holders.move_to_end(key)
            holders.add(replica)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        self._retain(lambda r: r != replica)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        live = set(replicas)
        self._retain(lambda r: r in live)

    def _retain(self, keep: Callable[[Hashable], bool]) -> None:
        for key in list(self._holders):
            holders = {r for r in self._holders[key] if keep(r)}
            if holders:
                self._holders[key] = holders
            else:
                del self._holders[key]
