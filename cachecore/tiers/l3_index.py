"""The L3 store's accounting, apart from its bytes: which objects each tenant holds (oldest first),
bytes per tenant and in all, each tenant's byte limit (``max_l3_bytes``), and the fair choice of what
to evict (:meth:`L3Index.victims`), and the soft pins of named caches (``pins``: hex chain hash of a
chunk -> until): within one tenant, pinned objects are evicted after its unpinned ones; which tenant
gives up an object is decided as without pins (a pin never protects a tenant over its share).

Tenants are keyed by their encoded name component (:func:`cachecore.tiers.l3_names.enc`). The index
starts unloaded: until :meth:`L3Index.load` (a listing of the backend) every update is a no-op, so a
store that never needed the accounting never lists its backend. No I/O, no tensors, not thread-safe:
:class:`~cachecore.tiers.remote.RemoteStore` calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from cachecore.tiers.backends.base import ObjectInfo

#: One eviction victim: (tenant key, object name, size in bytes).
Victim = tuple[str, str, int]


class _Entry(NamedTuple):
    size: int
    mtime: float


class L3Index:
    def __init__(self) -> None:
        self._objects: dict[str, OrderedDict[str, _Entry]] | None = None
        self.usage: dict[str, int] = {}  # tenant key -> bytes (only tenants holding something)
        self.total = 0
        self.limits: dict[str, int] = {}  # tenant key -> max bytes
        self.pins: dict[str, float] = {}  # hex chain hash (the name's last part) -> until (unix time)

    @property
    def loaded(self) -> bool:
        return self._objects is not None

    def load(self, listing: Iterable[tuple[str, ObjectInfo]]) -> None:
        """Replace the accounting by a listing of ``(tenant key, object)``; age order is write time."""
        self._objects, self.usage, self.total = {}, {}, 0
        for tenant, info in sorted(listing, key=lambda x: x[1].mtime):
            self.remember(tenant, info.name, info.size, info.mtime)

    def remember(self, tenant: str, name: str, size: int, mtime: float) -> None:
        """``name`` (``size`` bytes) is stored for ``tenant``: its most recent object."""
        if self._objects is None:
            return
        self.forget(tenant, name)
        self._objects.setdefault(tenant, OrderedDict())[name] = _Entry(size, mtime)
        self.usage[tenant] = self.usage.get(tenant, 0) + size
        self.total += size

    def forget(self, tenant: str, name: str) -> None:
        """``name`` is gone (deleted, evicted, quarantined); nothing if it was not known."""
        if self._objects is None:
            return
        names = self._objects.get(tenant)
        entry = names.pop(name, None) if names is not None else None
        if entry is None:
            return
        self.usage[tenant] -= entry.size
        self.total -= entry.size
        if not names:
            del self._objects[tenant]
            del self.usage[tenant]

    def seen(self, tenant: str, name: str, size: int, created: float) -> None:
        """A read delivered ``name``: it becomes the tenant's most recently used (and enters the
        index if another process wrote it)."""
        if self._objects is None:
            return
        names = self._objects.get(tenant)
        if names is not None and name in names:
            names.move_to_end(name)
        else:
            self.remember(tenant, name, size, created)

    def matching(self, match: Callable[[str], bool]) -> list[tuple[str, str]]:
        """``(tenant key, name)`` of every known object whose name matches."""
        if self._objects is None:
            return []
        return [(t, n) for t, names in self._objects.items() for n in names if match(n)]

    def entries(self):
        """``(tenant key, name, size)`` of every known object."""
        for t, names in (self._objects or {}).items():
            for n, e in names.items():
                yield t, n, e.size

    def objects(self) -> int:
        return sum(len(v) for v in self._objects.values()) if self._objects is not None else 0

    def pin(self, keys: Iterable[str], until: float | None, now: float) -> None:
        """Pin the chunks named by hex chain hash ``keys`` until ``until`` (None: unpin); lapsed pins
        are forgotten. Kept whether the index is loaded or not."""
        self.pins = {k: u for k, u in self.pins.items() if u > now}
        for k in keys:
            if until is None:
                self.pins.pop(k, None)
            else:
                self.pins[k] = float(until)

    def _evict_order(self, names: OrderedDict[str, _Entry], now: float):
        """``names`` oldest first, the pinned ones after all others (lazily)."""
        if not self.pins:
            yield from names.items()
            return
        held_back = []
        for item in names.items():
            until = self.pins.get(item[0].rsplit("/", 1)[-1])
            if until is not None and until > now:
                held_back.append(item)
            else:
                yield item
        yield from held_back

    def victims(self, writer: str | None, size: int, capacity: int | None, *, now: float | None = None
                ) -> list[Victim] | None:
        """Objects to evict so that ``writer`` can add ``size`` bytes (``writer=None``: bring every
        tenant within its limit and the store within ``capacity``), or None if that cannot be done
        without pushing another tenant below its fair share. Per-tenant limits first (a tenant over
        its own evicts its own oldest), then capacity: the oldest object of a tenant over its equal
        share goes first; within a tenant its unpinned objects go before its pinned ones (pins lapse at
        ``now``). Mutates nothing. The index must be loaded."""
        assert self._objects is not None
        now = time.time() if now is None else now
        usage = dict(self.usage)
        cursors = {t: self._evict_order(names, now) for t, names in self._objects.items()}
        heads: dict[str, tuple[str, _Entry] | None] = {}
        victims: list[Victim] = []

        def head(t: str) -> tuple[str, _Entry] | None:
            if t not in heads:
                heads[t] = next(cursors[t], None) if t in cursors else None
            return heads[t]

        def take(t: str) -> None:
            n, e = heads.pop(t)  # type: ignore[misc]
            victims.append((t, n, e.size))
            usage[t] -= e.size

        for t, limit in self.limits.items():
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
        while sum(usage.values()) > capacity:
            holders = [t for t, b in usage.items() if b > 0]
            share = capacity / max(len(holders), 1)
            over = [t for t in holders if usage[t] > share and head(t) is not None]
            if not over:
                return None
            t = min(over, key=lambda t: head(t)[1].mtime)  # type: ignore[index]
            take(t)
        return victims

    def check(self) -> None:
        """Assert that usage per tenant and in all add up (``AssertionError`` naming the first off)."""
        if self._objects is None:
            return
        for t, names in self._objects.items():
            assert self.usage.get(t, 0) == sum(e.size for e in names.values()), f"usage of {t} is off"
        assert self.total == sum(self.usage.values()), "total usage is off"
