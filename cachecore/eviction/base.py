"""The eviction policy seam: what every tier (L1 and L2 ``BlockPool``, L3 ``L3Index``) asks when it must
make room, and the one type every policy implements.

**The contract.** A store keeps its own entries, ref counts, index and free list; it tells its
:class:`EvictionPolicy` which of those entries are *evictable* and asks it which to give up.

What the policy is told (the store calls these under its own lock, never concurrently):

- :meth:`~EvictionPolicy.add`: entries became evictable (a pool's cached blocks reaching ref count 0,
  one freed block table deepest first; an L3 object written). Each entry carries its ``owner`` (the
  tenant it counts for), ``freed_at`` (recency: larger is more recent), ``hits`` (times it was reused)
  and ``block_hash`` (its pin key); an L3 object also its ``size`` in bytes.
- :meth:`~EvictionPolicy.take`: evictable entries were taken by a hit (a pool's blocks held again).
- :meth:`~EvictionPolicy.hit`: an entry was reused and stays evictable (an L3 read): its recency
  and ``hits`` changed.
- :meth:`~EvictionPolicy.remove`: an entry left the store (``evicted=True`` when the policy's own
  choice or a cap made room; ``False`` for a flush, a delete, a corrupt or expired object);
  :meth:`~EvictionPolicy.remove_many` for several at once.
- ``pins`` (:class:`Pins`): named caches' soft pins, by pin key, lapsing by themselves.

What it answers, given per-owner usage, share weights, the store's capacity and per-owner caps:

- :meth:`~EvictionPolicy.victims`: the ordered entries to evict so that ``owner`` can allocate
  ``need`` more units (a pool: blocks), and how many of them were taken below their owner's share.
- :meth:`~EvictionPolicy.victims_bytes`: the entries to evict so that ``writer`` can add ``size``
  bytes within every owner's byte limit and the capacity (L3), or None when that cannot be done
  without pushing another owner below its share.
- :meth:`~EvictionPolicy.order`: one owner's evictable entries in the order it gives them up (a cap
  trims its owner this way); pinned entries (pin not lapsed) always after the others.

Every policy keeps **fair sharing between owners** (the product contract, ``docs/design.md``): an
owner is protected up to its weighted share of the store (:func:`share`), a flood evicts only the
flooder's entries or others' surplus, and a pin only reorders its own owner's evictions. A policy
chooses the order *inside* an owner and between owners that may give up an entry; which owners may
is fixed (:class:`~cachecore.eviction.fair_lru.FairLRU` implements it; a new policy usually subclasses
it and overrides ordering only). Answers mutate nothing: the store then evicts and calls ``remove``.

A new policy is one module in this package plus one line in
:data:`~cachecore.eviction.registry.EVICTION_POLICIES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import ClassVar, Protocol

__all__ = ["EvictionPolicy", "Evictable", "Pins", "share", "total_weight"]

Clock = Callable[[], float]


class Evictable(Protocol):
    """What a policy reads from an entry: :class:`~cachecore.free_queue.Block` in a pool,
    :class:`~cachecore.tiers.remote.capacity.L3Object` in L3 (which also has ``size``, in bytes)."""

    owner: str | None
    block_hash: Hashable  # the pin key: a block's chain hash, an L3 object's chunk key (hex)
    freed_at: float  # recency: larger = more recently freed / written
    hits: int


def total_weight(usage: Mapping[str, int], weights: Mapping[str, int], extra: str | None) -> int:
    """Sum of the weights (default 1) of the owners with usage, plus ``extra`` (the allocating owner)."""
    active = {o for o, u in usage.items() if u > 0}
    if extra is not None:
        active.add(extra)
    return sum(weights.get(o, 1) for o in active)


def share(capacity: int, owner: str, weights: Mapping[str, int], total: int) -> int:
    """``owner``'s protected share of ``capacity`` units: ``capacity * weight // total`` (integral)."""
    return capacity * weights.get(owner, 1) // total


class Pins:
    """Soft pins by key: ``key -> until`` (a time of the store's clock). A pin lapses by itself once
    ``until`` passes; ``expire_at`` is the earliest until (when lapsed pins are next purged)."""

    __slots__ = ("until", "expire_at")

    def __init__(self) -> None:
        self.until: dict[Hashable, float] = {}
        self.expire_at = float("inf")

    def __len__(self) -> int:
        return len(self.until)

    def __bool__(self) -> bool:
        return bool(self.until)

    def get(self, key: Hashable) -> float | None:
        return self.until.get(key)

    def is_pinned(self, key: Hashable, now: float) -> bool:
        until = self.until.get(key)
        return until is not None and until > now

    def pin(self, keys: Iterable[Hashable], until: float, now: float) -> None:
        """Pin ``keys`` until ``until`` (replaces an earlier pin's until)."""
        until = float(until)
        self.expire(now)
        for k in keys:
            self.until[k] = until
        if until < self.expire_at:
            self.expire_at = until

    def unpin(self, keys: Iterable[Hashable]) -> int:
        """Remove the pins of ``keys``; returns how many were pinned."""
        n = 0
        for k in keys:
            n += self.until.pop(k, None) is not None
        if not self.until:
            self.expire_at = float("inf")
        return n

    def expire(self, now: float, *, force: bool = False) -> None:
        """Forget the pins that lapsed (O(pins); only once the earliest until passed unless ``force``)."""
        if not force and now < self.expire_at:
            return
        self.until = {k: u for k, u in self.until.items() if u > now}
        self.expire_at = min(self.until.values(), default=float("inf"))

    def active(self, clock: Clock) -> dict[Hashable, float] | None:
        """The pins (lapsed ones purged) when there are any, else None; reads ``clock`` only then."""
        if not self.until:
            return None
        self.expire(clock())
        return self.until or None

    def check(self, key_type: type | None = None) -> None:
        if key_type is not None:
            assert all(type(k) is key_type and type(u) is float for k, u in self.until.items()), "malformed pin"
        assert self.expire_at <= min(self.until.values(), default=float("inf")), "pin expiry horizon too late"


def unpinned_first(entries: Iterable, pins: Mapping[Hashable, float], now: float) -> Iterator:
    """``entries`` in their order, those pinned at ``now`` held back to the end (lazily)."""
    held_back = []
    for entry in entries:
        until = pins.get(entry.block_hash)
        if until is not None and until > now:
            held_back.append(entry)
        else:
            yield entry
    yield from held_back


class EvictionPolicy(ABC):
    """One store's eviction policy (module docstring: the contract). Not thread-safe: its store calls
    it under the store's lock. ``name`` is its key in the registry."""

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.pins = Pins()

    # ------------------------------------------------------------------ what it is told
    @abstractmethod
    def add(self, entries: Sequence[Evictable]) -> None:
        """``entries`` became evictable, in this order (a freed block table: deepest first)."""

    @abstractmethod
    def remove(self, entry: Evictable, *, evicted: bool = False) -> None:
        """``entry`` is no longer evictable (evicted by a choice of this policy or a cap, or dropped)."""

    def remove_many(self, entries: Iterable[Evictable], *, evicted: bool = False) -> None:
        """``remove`` for each of ``entries`` (a store evicting several at once)."""
        for entry in entries:
            self.remove(entry, evicted=evicted)

    def take(self, entries: Iterable[Evictable]) -> None:
        """Evictable ``entries`` were taken by a hit (held again; ``add`` when freed)."""
        for entry in entries:
            self.remove(entry)

    def hit(self, entry: Evictable) -> None:
        """``entry`` was reused and stays evictable (its ``freed_at`` / ``hits`` may have changed)."""
        self.remove(entry)
        self.add((entry,))

    # ------------------------------------------------------------------ what it answers
    @abstractmethod
    def evictable(self, owner: str | None) -> int:
        """How many of ``owner``'s entries are evictable."""

    @abstractmethod
    def owners(self) -> Iterable[str | None]:
        """Owners with at least one evictable entry."""

    @abstractmethod
    def order(self, owner: str | None, clock: Clock) -> Iterator[Evictable]:
        """``owner``'s evictable entries in the order it gives them up, pinned ones after all others
        (``clock`` read only when pins exist). Lazy: nothing may change while it is iterated."""

    @abstractmethod
    def victims(self, need: int, owner: str, usage: dict[str, int], weights: Mapping[str, int], capacity: int,
                clock: Clock) -> tuple[list[Evictable], int]:
        """The ``need`` entries (``need`` <= evictable entries) to evict, in order, so that ``owner``
        can allocate; ``usage`` (units per owner, ``owner``'s already counting what it takes without
        evicting; the policy may change this dict) and ``weights`` decide the shares of ``capacity``.
        Also returns how many were taken from an owner at or below its share (the last resort)."""

    @abstractmethod
    def victims_bytes(self, writer: str | None, size: int, capacity: int | None, usage: Mapping[str, int],
                      weights: Mapping[str, int], limits: Mapping[str, int], clock: Clock) -> list | None:
        """The entries to evict so that ``writer`` can add ``size`` bytes (``writer=None``: bring every
        owner within ``limits`` and the store within ``capacity``), or None when that would push an
        owner below its share (or ``size`` exceeds a limit or the capacity)."""

    @abstractmethod
    def check(self, evictable: Mapping[str | None, list[Evictable]]) -> None:
        """Assert the policy's invariants against the store's evictable entries per owner (in the
        store's own order, e.g. a pool's free queue); ``AssertionError`` naming the first broken."""
