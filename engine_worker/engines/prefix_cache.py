"""The simulator's prefix cache: blocks of tokens in an LRU of limited capacity.

Blocks are named by the chained hashes of :mod:`sluice.prefix`, so a block is reused
only when the whole prefix up to it is the same. A request looks up its blocks
(:meth:`PrefixCache.match`: the leading ones already cached count as ``cached_tokens``
and skip prefill) and, once prefilled, stores them (:meth:`PrefixCache.store`), evicting
the least recently used blocks beyond ``capacity_blocks``. Every change is queued as a
KV event in the shape the vLLM worker publishes (:class:`~engine_worker.protocol.KVEvent`),
for the worker to report to the gateways' prefix index.
"""

from __future__ import annotations

from collections import OrderedDict

from engine_worker.protocol import KVEvent


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[str, None] = OrderedDict()
        self._events: list[KVEvent] = []
        #: Blocks asked for and blocks found, over all lookups (the engine's hit rate).
        self.queried = 0
        self.hit = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return f"PrefixCache({len(self._blocks)}/{self.capacity_blocks} blocks, hit {self.hit}/{self.queried})"

    def match(self, hashes: list[str]) -> int:
        """Leading blocks of ``hashes`` that are cached; they become the most recently used."""
        found = 0
        for h in hashes:
            if h not in self._blocks:
                break
            found += 1
        # Tail first, head last: a prefix is evicted from its end (as vLLM frees blocks),
        # so what stays cached is still a usable prefix.
        for h in reversed(hashes[:found]):
            self._blocks.move_to_end(h)
        self.queried += len(hashes)
        self.hit += found
        return found

    def store(self, hashes: list[str]) -> None:
        """Cache ``hashes`` (a prefilled prompt's blocks), evicting the least recently used."""
        if self.capacity_blocks <= 0:
            return
        stored = []
        # A prefix: later blocks are useless without earlier ones; the head is touched last.
        for h in reversed(hashes[:self.capacity_blocks]):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                stored.append(h)
        removed = []
        while len(self._blocks) > self.capacity_blocks:
            removed.append(self._blocks.popitem(last=False)[0])
        if stored:
            self._events.append(KVEvent(type="stored", block_hashes=stored[::-1]))
        if removed:
            self._events.append(KVEvent(type="removed", block_hashes=removed))

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
