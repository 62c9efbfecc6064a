"""What a vLLM replica's device cache holds, as Strata's block hashes: the KV events the worker derives
for the router, and the per-tenant residency of the stats.

vLLM keys its blocks with its own hashes (salted by the request's ``cache_salt``); Strata's router
computes a request's hashes with Strata's chain (``cachecore.routing.hashes``) from the tenant's
scope salt. So the worker records, for every prompt vLLM computed, the Strata hashes of its full
blocks (``stored``) and mirrors vLLM's eviction order: least recently used first, once more blocks
are recorded than vLLM's cache has (``capacity``, from its KV size). It is an estimate of vLLM's
contents, not a copy: the router's ``correct()`` drops what a replica turns out not to have, and a
flush removes what it made unreachable (reason ``flushed``) at once.

Each change is one ``EventBatch`` in the replica's ``EventLog`` (tier ``l1``). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from cachecore.events import BlockRemoved, BlockStored, EventLog


class DerivedBlocks:
    def __init__(self, capacity: int, events: EventLog) -> None:
        self.capacity = max(1, int(capacity))
        self.events = events
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, tuple[str, str]] = OrderedDict()  # hash -> (owner, revision)
        self.evictions = 0

    def stored(self, owner: str, revision: str, hashes: Sequence[bytes]) -> None:
        """A request of ``owner`` had vLLM compute (or reuse) these blocks: they are now the most
        recently used; the least recently used beyond ``capacity`` leave (reason ``evicted``)."""
        if not hashes:
            return
        with self._lock:
            new = []
            for h in hashes:
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                else:
                    self._blocks[h] = (owner, revision)
                    new.append(h)
            evicted = []
            while len(self._blocks) > self.capacity:
                evicted.append(self._blocks.popitem(last=False)[0])
            self.evictions += len(evicted)
            self.events.publish(BlockStored("l1", tuple(new)), BlockRemoved("l1", tuple(evicted), "evicted"))

    def flush(self, match: Callable[[str, str], bool]) -> int:
        """Forget every block whose ``(owner, revision)`` matches (reason ``flushed``); how many."""
        with self._lock:
            gone = [h for h, (owner, rev) in self._blocks.items() if match(owner, rev)]
            for h in gone:
                del self._blocks[h]
            self.events.publish(BlockRemoved("l1", tuple(gone), "flushed"))
            return len(gone)

    def count(self, match: Callable[[str, str], bool] | None = None) -> int:
        with self._lock:
            if match is None:
                return len(self._blocks)
            return sum(1 for owner, rev in self._blocks.values() if match(owner, rev))

    def prefix(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` recorded (an estimate of vLLM's device cache; no LRU change)."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                n += 1
            return n

    def by_owner(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(owner for owner, _ in self._blocks.values()))
