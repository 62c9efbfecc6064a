"""``fair_lru``, the default policy: weighted fair share between owners, least recently freed first
inside one (deepest first inside one freed block table), pinned entries last.

**In a pool** (:meth:`FairLRU.victims`: an allocation of N blocks). Each owner with usage (and the one
allocating) is *protected* up to ``capacity * weight // total_weight`` blocks (:func:`~cachecore.
eviction.base.share`). Each victim is the least recently freed head among owners **over** their share
(not the allocating owner); only when none is over, the allocating owner's own head; only when neither
exists (it holds its share and more in running requests), the least recently freed head of anyone,
counted as a *protected* eviction (a running request is never refused for the sake of idle cache).
Usage moves with every victim (the victim's owner -1, the allocating owner +1), so shares are
re-evaluated per block.

**In L3** (:meth:`FairLRU.victims_bytes`: a write of ``size`` bytes). Per-owner byte limits first (an
owner over its own evicts its own oldest), then the capacity: the head with the oldest ``freed_at``
among owners over their weighted share ``capacity * weight / total_weight`` of the owners holding
bytes (the writer included, with its new object counted), until the store fits; None (refuse the
write) when no owner over its share has anything left to give.

Within one owner, entries go least recently freed (written, or read in L3) first, pinned ones after all
others. Subclasses change only the order: override :meth:`order`, :meth:`rank` (how two owners' heads
compare) and the bookkeeping hooks; the fairness rules above stay.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence

from cachecore.eviction.base import Clock, Evictable, EvictionPolicy, total_weight, unpinned_first

__all__ = ["FairLRU"]


class FairLRU(EvictionPolicy):
    name = "fair_lru"

    def __init__(self) -> None:
        super().__init__()
        # Per owner: its evictable entries, least recently freed first. A plain dict keeps insertion
        # order and deletes and inserts for less than an OrderedDict (every hit and free does one per
        # block); the slots its head loses to evictions are skipped by iteration until the next resize
        # compacts them.
        self._lru: dict[str | None, dict[Evictable, None]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        # The batched forms below work on ``_lru`` directly; a subclass that keeps its entries
        # elsewhere (overrides ``remove``) gets the per-entry forms unless it batches them itself.
        super().__init_subclass__(**kwargs)
        if "remove" in cls.__dict__:
            for name in ("remove_many", "take"):
                if name not in cls.__dict__:
                    setattr(cls, name, getattr(EvictionPolicy, name))

    # ------------------------------------------------------------------ told
    def add(self, entries: Sequence[Evictable]) -> None:
        lrus = self._lru
        lru, lru_owner = None, object()
        for entry in entries:  # plain loops: cheaper here than groupby and C-level maps
            if entry.owner is not lru_owner:
                lru_owner = entry.owner
                lru = lrus.get(lru_owner)
                if lru is None:
                    lru = lrus[lru_owner] = {}
            lru[entry] = None

    def remove(self, entry: Evictable, *, evicted: bool = False) -> None:
        lru = self._lru[entry.owner]
        del lru[entry]
        if not lru:
            del self._lru[entry.owner]

    def remove_many(self, entries: Iterable[Evictable], *, evicted: bool = False) -> None:
        lrus = self._lru
        lru, lru_owner = None, object()
        for entry in entries:
            if entry.owner is not lru_owner:
                if lru is not None and not lru:
                    del lrus[lru_owner]
                lru_owner = entry.owner
                lru = lrus[lru_owner]
            del lru[entry]
        if lru is not None and not lru:
            del lrus[lru_owner]

    def take(self, entries: Sequence[Evictable]) -> None:
        self.remove_many(entries)  # the hot path of every hit

    def hit(self, entry: Evictable) -> None:
        lru = self._lru[entry.owner]
        del lru[entry]  # to the end
        lru[entry] = None

    # ------------------------------------------------------------------ answers
    def evictable(self, owner: str | None) -> int:
        return len(self._lru.get(owner, ()))

    def owners(self) -> list[str | None]:
        return list(self._lru)

    def order(self, owner: str | None, clock: Clock) -> Iterator[Evictable]:
        entries = self._lru.get(owner, ())
        if not self.pins:
            return iter(entries)
        pins = self.pins.active(clock)
        return unpinned_first(entries, pins, clock()) if pins else iter(entries)

    def rank(self, entry: Evictable) -> object:
        """Between owners that may give up their head, the smaller rank goes first."""
        return entry.freed_at

    def victims(self, need: int, owner: str, usage: dict[str, int], weights: Mapping[str, int], capacity: int,
                clock: Clock) -> tuple[list[Evictable], int]:
        owners = self.owners()
        if owners == [owner]:  # only the allocating owner has evictable entries: its own order
            return list(itertools.islice(self.order(owner, clock), need)), 0
        rank = self.rank
        cursors = {o: self.order(o, clock) for o in owners}
        heads: dict[str | None, Evictable] = {o: next(it) for o, it in cursors.items()}
        victims: list[Evictable] = []
        protected = 0
        total = total_weight(usage, weights, owner)
        while len(victims) < need:
            best = best_rank = None
            for o, entry in heads.items():
                if o == owner or o is None:
                    continue
                if usage[o] > capacity * weights.get(o, 1) // total:
                    r = rank(entry)
                    if best is None or r < best_rank:
                        best, best_rank = entry, r
            if best is None:
                best = heads.get(owner)
            if best is None:  # last resort: the first head of anyone
                best = min(heads.values(), key=rank)
                protected += 1
            victims.append(best)
            victim_owner = best.owner
            usage[victim_owner] -= 1
            usage[owner] += 1
            if not usage[victim_owner] and victim_owner != owner:  # it left the owners with usage
                total -= weights.get(victim_owner, 1)
            following = next(cursors[victim_owner], None)
            if following is None:
                del heads[victim_owner]
            else:
                heads[victim_owner] = following
        return victims, protected

    def victims_bytes(self, writer: str | None, size: int, capacity: int | None, usage: Mapping[str, int],
                      weights: Mapping[str, int], limits: Mapping[str, int], clock: Clock) -> list | None:
        usage = dict(usage)
        cursors = {t: self.order(t, clock) for t in self.owners()}
        heads: dict[str | None, Evictable | None] = {}
        victims: list = []

        def head(t: str) -> Evictable | None:
            if t not in heads:
                heads[t] = next(cursors[t], None) if t in cursors else None
            return heads[t]

        def take(t: str) -> None:
            entry = heads.pop(t)
            victims.append(entry)
            usage[t] -= entry.size  # type: ignore[union-attr]

        for t, limit in limits.items():
            extra = size if t == writer else 0
            if extra > limit:
                return None
            while usage.get(t, 0) + extra > limit:
                if head(t) is None:
                    return None
                take(t)
        if capacity is None:
            return victims
        if size > capacity:
            return None
        if writer is not None:
            usage[writer] = usage.get(writer, 0) + size
        rank = self.rank
        while sum(usage.values()) > capacity:
            holders = [t for t, b in usage.items() if b > 0]
            total = max(sum(weights.get(t, 1) for t in holders), 1)
            over = [t for t in holders if usage[t] > capacity * weights.get(t, 1) / total and head(t) is not None]
            if not over:
                return None
            take(min(over, key=lambda t: rank(head(t))))
        return victims

    # ------------------------------------------------------------------ invariants
    def check(self, evictable: Mapping[str | None, list[Evictable]]) -> None:
        mine = {o: list(lru) for o, lru in self._lru.items()}
        theirs = {o: list(v) for o, v in evictable.items() if v}
        assert mine == theirs, f"per-owner evictable order {_ids(mine)} != the store's order {_ids(theirs)}"


def _ids(order: dict) -> dict:
    return {o: [getattr(e, "block_id", getattr(e, "name", e)) for e in v] for o, v in order.items()}
