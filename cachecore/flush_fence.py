"""FlushFence: what a request, or a write it queued, may still register after flushes and rollouts.

A flush is a (generation, match) pair: ``flush`` moves the fence to a new generation and, while
anything entered at an older one is alive, remembers ``match``. ``stale(gen, tag)`` is then True for
a tag the flush matches from anything entered at ``gen`` before it, so a flush stays flushed in
every tier, while other tenants' requests keep caching. A retired (model, revision) may neither hit
nor store: ``stale`` is True for it whatever the generation, and ``retired`` answers for what has no
generation (an L1 eviction on its way down, an admission).

Holders: ``enter`` (a request at admission: it holds the current generation), ``hold`` (a background
write keeping its request's generation beyond the request); each ends with one ``leave``. A flush
older than every live holder is forgotten.

Thread-safe: every method takes the lock it was given (the engine's ``RLock``), so callers may
already hold it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from cachecore.tiers.base import Tag


class FlushFence:
    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._gen = 0
        self._flushes: list[tuple[int, Callable[[Tag], bool]]] = []  # kept while a holder predates them
        self._holders: Counter[int] = Counter()
        self._retired: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ holders
    def enter(self) -> int:
        """Hold the current generation (a request being admitted) and return it."""
        with self._lock:
            self._holders[self._gen] += 1
            return self._gen

    def hold(self, gen: int) -> None:
        """Hold ``gen`` once more (a background write of a request entered at ``gen``)."""
        with self._lock:
            self._holders[gen] += 1

    def leave(self, gen: int) -> None:
        """End one ``enter`` or ``hold`` of ``gen``; forget the flushes no live holder predates."""
        with self._lock:
            self._holders[gen] -= 1
            if not self._holders[gen]:
                del self._holders[gen]
            oldest = min(self._holders, default=self._gen)
            if self._flushes and self._flushes[0][0] <= oldest:
                self._flushes = [(g, m) for g, m in self._flushes if g > oldest]

    # ------------------------------------------------------------------ flushes and rollouts
    def flush(self, match: Callable[[Tag], bool]) -> int:
        """A new generation: whatever entered before it and matches ``match`` is stale from now on.
        Returns the new generation."""
        with self._lock:
            self._gen += 1
            if self._holders:
                self._flushes.append((self._gen, match))
            return self._gen

    def retire(self, model: str, revision: str) -> None:
        with self._lock:
            self._retired.add((model, revision))

    def unretire(self, model: str, revision: str) -> None:
        with self._lock:
            self._retired.discard((model, revision))

    # ------------------------------------------------------------------ questions
    def retired(self, model: str, revision: str) -> bool:
        """Whether (model, revision) may neither hit nor store."""
        with self._lock:
            return (model, revision) in self._retired

    def stale(self, gen: int, tag: Tag) -> bool:
        """Whether something entered at ``gen`` for ``tag`` must register nothing: its revision is
        retired, or a flush after ``gen`` matches it."""
        with self._lock:
            return self.retired(tag.model, tag.revision) or any(g > gen and match(tag) for g, match in self._flushes)

    def pending(self) -> int:
        """Flushes still remembered (0 once nothing entered before the last one is alive)."""
        with self._lock:
            return len(self._flushes)
