"""``value_aware``: fair share between owners exactly as ``fair_lru``, but inside an owner (and between
owners that may give up an entry) the entry worth least goes first: expected reuse x recompute cost
per byte, aged (GreedyDual-Size-Frequency).

An entry's value is fixed when it becomes evictable::

    value = floor + (1 + hits) * cost_per_byte(entry)

``hits`` is its reuse so far (the expected reuse), ``cost_per_byte`` what recomputing it costs per byte
it occupies (default ``1 / size``: a pool's blocks all hold the same tokens and bytes; an L3 object's
``size`` is its bytes; pass another function for a store that knows its models' prefill rates). The
``floor`` is the value of the last entry evicted (never lower than before), so entries not reused for
a long time lose to newly freed ones (aging) instead of staying forever on old hit counts. Along one
freed block table (deepest first) a block is never worth more than the block before it in the chain,
so a chain's tail goes before its prefix (a block whose prefix is gone can never be hit). Ties: least
recently freed first. Pins: an owner's pinned entries go after its unpinned ones, as in ``fair_lru``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence

from cachecore.eviction.base import Clock, Evictable, unpinned_first
from cachecore.eviction.fair_lru import FairLRU

__all__ = ["ValueAware"]


def _per_byte(entry: Evictable) -> float:
    return 1.0 / getattr(entry, "size", 1)


class ValueAware(FairLRU):
    name = "value_aware"

    def __init__(self, cost_per_byte: Callable[[Evictable], float] | None = None) -> None:
        super().__init__()
        self.cost_per_byte = cost_per_byte or _per_byte
        self.floor = 0.0
        self._seq = itertools.count()
        # Per owner: entry -> its record [value, freed_at, seq, entry], and a heap of records (stale
        # ones, whose entry maps to another record or none, are skipped and compacted away).
        self._live: dict[str | None, dict[Evictable, list]] = {}
        self._heaps: dict[str | None, list[list]] = {}

    # ------------------------------------------------------------------ told
    def add(self, entries: Sequence[Evictable]) -> None:
        floor, seq, cost = self.floor, self._seq, self.cost_per_byte
        prev_owner, prev_value = object(), 0.0
        for entry in reversed(entries):  # prefix first: a block is worth at most its chain predecessor
            owner = entry.owner
            value = floor + (1 + entry.hits) * cost(entry)
            if owner is prev_owner and value > prev_value:
                value = prev_value
            prev_owner, prev_value = owner, value
            record = [value, entry.freed_at, next(seq), entry]
            live = self._live.get(owner)
            if live is None:
                live = self._live[owner] = {}
                self._heaps[owner] = []
            live[entry] = record
            heapq.heappush(self._heaps[owner], record)

    def remove(self, entry: Evictable, *, evicted: bool = False) -> None:
        owner = entry.owner
        live = self._live[owner]
        record = live.pop(entry)
        if evicted and record[0] > self.floor:
            self.floor = record[0]
        if not live:
            del self._live[owner], self._heaps[owner]
        elif len(self._heaps[owner]) > 2 * len(live) + 32:
            heap = [r for r in self._heaps[owner] if live.get(r[3]) is r]
            heapq.heapify(heap)
            self._heaps[owner] = heap

    def take(self, entries: Sequence[Evictable]) -> None:
        for entry in entries:
            self.remove(entry)

    def hit(self, entry: Evictable) -> None:
        self.remove(entry)
        self.add((entry,))

    # ------------------------------------------------------------------ answers
    def evictable(self, owner: str | None) -> int:
        return len(self._live.get(owner, ()))

    def owners(self) -> list[str | None]:
        return list(self._live)

    def value(self, entry: Evictable) -> float:
        return self._live[entry.owner][entry][0]

    def rank(self, entry: Evictable) -> object:
        return self._live[entry.owner][entry][:3]

    def order(self, owner: str | None, clock: Clock) -> Iterator[Evictable]:
        entries = self._sorted(owner)
        if not self.pins:
            return entries
        pins = self.pins.active(clock)
        return unpinned_first(entries, pins, clock()) if pins else entries

    def _sorted(self, owner: str | None) -> Iterator[Evictable]:
        """``owner``'s live entries, lowest record first, walking its heap without popping it."""
        heap, live = self._heaps.get(owner), self._live.get(owner)
        if not heap:
            return
        frontier = [(heap[0], 0)]
        n = len(heap)
        while frontier:
            record, i = heapq.heappop(frontier)
            if live.get(record[3]) is record:
                yield record[3]
            for child in (2 * i + 1, 2 * i + 2):
                if child < n:
                    heapq.heappush(frontier, (heap[child], child))

    # ------------------------------------------------------------------ invariants
    def check(self, evictable: Mapping[str | None, list[Evictable]]) -> None:
        mine = {o: set(live) for o, live in self._live.items()}
        theirs = {o: set(v) for o, v in evictable.items() if v}
        assert mine == theirs, "value_aware's evictable entries differ from the store's"
        for o, live in self._live.items():
            in_heap = {id(r) for r in self._heaps[o]}
            assert all(id(r) in in_heap and r[3] is e for e, r in live.items()), f"{o!r}: a live record off its heap"
