"""L3 capacity and per-tenant byte accounting, apart from the bytes: which objects each tenant holds,
bytes per tenant and in all, each tenant's byte limit (``max_l3_bytes``) and share weight
(``share_weight``), and what to evict (:meth:`L3Index.victims`), asked of the same eviction policy type
as L1 and L2 (``policy``, an :class:`~cachecore.eviction.base.EvictionPolicy`, ``fair_lru`` by default:
a tenant over its weighted share gives up its least recently used object first), which also keeps the
soft pins of named caches (``pins``: hex chain hash of a chunk -> until): within one tenant, pinned
objects are evicted after its unpinned ones; which tenant gives up an object is decided as without
pins (a pin never protects a tenant over its share). :func:`l3_figures`: the L3 tier row of the
stats, from :meth:`~cachecore.tiers.remote.store.RemoteStore.gauges`.

Tenants are keyed by their encoded name component (:func:`cachecore.tiers.remote.names.enc`). The index
starts unloaded: until :meth:`L3Index.load` (a listing of the backend) every update is a no-op, so a
store that never needed the accounting never lists its backend. No I/O, no tensors, not thread-safe:
:class:`~cachecore.tiers.remote.store.RemoteStore` calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from cachecore.eviction.base import EvictionPolicy, Pins
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY, make_policy
from cachecore.tiers.backends.base import ObjectInfo
from cachecore.tiers.remote.names import chunk_hex

__all__ = ["L3Index", "L3Object", "Victim", "l3_figures"]

#: One eviction victim: (tenant key, object name, size in bytes).
Victim = tuple[str, str, int]


class L3Object:
    """One stored object as the eviction policy sees it (:class:`~cachecore.eviction.base.Evictable`):
    ``owner`` its tenant key, ``freed_at`` its write time (``mtime``), ``hits`` the reads this process
    delivered, ``block_hash`` its chunk key (hex chain hash of its last block: what pins name)."""

    __slots__ = ("owner", "name", "size", "freed_at", "hits", "block_hash")

    def __init__(self, owner: str, name: str, size: int, mtime: float) -> None:
        self.owner = owner
        self.name = name
        self.size = size
        self.freed_at = mtime
        self.hits = 0
        self.block_hash = chunk_hex(name)

    @property
    def mtime(self) -> float:
        return self.freed_at

    def __repr__(self) -> str:
        return f"L3Object({self.name!r}, {self.size})"


class L3Index:
    def __init__(self, policy: EvictionPolicy | str = DEFAULT_EVICTION_POLICY) -> None:
        self._objects: dict[str, dict[str, L3Object]] | None = None
        self.usage: dict[str, int] = {}  # tenant key -> bytes (only tenants holding something)
        self.total = 0
        self.limits: dict[str, int] = {}  # tenant key -> max bytes
        self.weights: dict[str, int] = {}  # tenant key -> share weight (absent: 1)
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy

    @property
    def pins(self) -> Pins:
        """Soft pins: hex chain hash (the name's last part) -> until (unix time); the policy's."""
        return self.policy.pins

    def use_policy(self, policy: EvictionPolicy | str) -> None:
        """Replace the eviction policy (its pins carried over), telling it every known object."""
        new = make_policy(policy) if isinstance(policy, str) else policy
        new.pins = self.policy.pins
        for names in (self._objects or {}).values():
            for obj in names.values():  # one at a time: objects are not one chain
                new.add((obj,))
        self.policy = new

    @property
    def loaded(self) -> bool:
        return self._objects is not None

    def load(self, listing: Iterable[tuple[str, ObjectInfo]]) -> None:
        """Replace the accounting by a listing of ``(tenant key, object)``; age order is write time."""
        for names in (self._objects or {}).values():
            for obj in names.values():
                self.policy.remove(obj)
        self._objects, self.usage, self.total = {}, {}, 0
        for tenant, info in sorted(listing, key=lambda x: x[1].mtime):
            self.remember(tenant, info.name, info.size, info.mtime)

    def remember(self, tenant: str, name: str, size: int, mtime: float) -> None:
        """``name`` (``size`` bytes) is stored for ``tenant``: its most recent object."""
        if self._objects is None:
            return
        self.forget(tenant, name)
        obj = self._objects.setdefault(tenant, {})[name] = L3Object(tenant, name, size, mtime)
        self.policy.add((obj,))
        self.usage[tenant] = self.usage.get(tenant, 0) + size
        self.total += size

    def has(self, tenant: str, name: str) -> bool:
        """Whether ``name`` is known as an object of ``tenant``."""
        return self._objects is not None and name in self._objects.get(tenant, ())

    def forget(self, tenant: str, name: str, *, evicted: bool = False) -> None:
        """``name`` is gone (deleted, quarantined; ``evicted``: chosen by ``victims``); nothing if it
        was not known."""
        if self._objects is None:
            return
        names = self._objects.get(tenant)
        entry = names.pop(name, None) if names is not None else None
        if entry is None:
            return
        self.policy.remove(entry, evicted=evicted)
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
        obj = names.get(name) if names is not None else None
        if obj is not None:
            names[name] = names.pop(name)  # most recently used last, as the policy is told
            obj.hits += 1
            self.policy.hit(obj)
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

    def set_limit(self, tenant: str, max_bytes: int | None) -> None:
        """Byte limit of ``tenant`` (None: none); ``ValueError`` if negative. Kept whether the index is
        loaded or not."""
        if max_bytes is None:
            self.limits.pop(tenant, None)
        else:
            if max_bytes < 0:
                raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
            self.limits[tenant] = int(max_bytes)

    def usage_matching(self, match: Callable[[str], bool]) -> dict[str, int]:
        """Bytes per tenant key of the known objects whose name matches (tenants with none left out)."""
        out: dict[str, int] = {}
        for t, name, size in self.entries():
            if match(name):
                out[t] = out.get(t, 0) + size
        return out

    def count_matching(self, match: Callable[[str], bool]) -> tuple[int, int]:
        """``(objects, bytes)`` of the known objects whose name matches."""
        sizes = [size for _, name, size in self.entries() if match(name)]
        return len(sizes), sum(sizes)

    def set_weight(self, tenant: str, weight: int) -> None:
        """Share weight of ``tenant`` (default 1) in the capacity's fair share. Kept whether the index is
        loaded or not."""
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ValueError(f"weight must be an int >= 1, got {weight!r}")
        if weight == 1:
            self.weights.pop(tenant, None)
        else:
            self.weights[tenant] = weight

    def objects(self) -> int:
        return sum(len(v) for v in self._objects.values()) if self._objects is not None else 0

    def pin(self, keys: Iterable[str], until: float | None, now: float) -> None:
        """Pin the chunks named by hex chain hash ``keys`` until ``until`` (None: unpin); lapsed pins
        are forgotten. Kept whether the index is loaded or not."""
        pins = self.policy.pins
        pins.expire(now, force=True)
        if until is None:
            pins.unpin(keys)
        else:
            pins.pin(keys, until, now)

    def victims(self, writer: str | None, size: int, capacity: int | None, *, now: float | None = None
                ) -> list[Victim] | None:
        """Objects to evict so that ``writer`` can add ``size`` bytes (``writer=None``: bring every
        tenant within its limit and the store within ``capacity``), or None if that cannot be done
        without pushing another tenant below its share. Per-tenant limits first (a tenant over its
        own evicts its own, in the policy's order), then capacity: with ``fair_lru``, the oldest
        object of a tenant over its weighted share ``capacity * weight / total weight`` goes first;
        within a tenant its unpinned objects go before its pinned ones (pins lapse at ``now``).
        Mutates nothing. The index must be loaded."""
        assert self._objects is not None
        now = time.time() if now is None else now
        chosen = self.policy.victims_bytes(writer, size, capacity, self.usage, self.weights, self.limits,
                                           lambda: now)
        return None if chosen is None else [(o.owner, o.name, o.size) for o in chosen]

    def check(self) -> None:
        """Assert that usage per tenant and in all add up and that the policy knows exactly the objects
        known here (``AssertionError`` naming the first off)."""
        if self._objects is None:
            return
        for t, names in self._objects.items():
            assert self.usage.get(t, 0) == sum(e.size for e in names.values()), f"usage of {t} is off"
        assert self.total == sum(self.usage.values()), "total usage is off"
        self.policy.check({t: list(names.values()) for t, names in self._objects.items()})
        self.policy.pins.check(str)


def l3_figures(g: dict, chunk_blocks: int, bytes_per_block: int) -> dict:
    """The L3 tier row from ``RemoteStore.gauges``: this scope's objects and bytes on the store
    (``used_bytes`` / ``stored_bytes``: the objects' real size, frames included), the store's own
    capacity (shared by every deployment on it) and totals; ``breaker_open`` / ``breaker_opens``: the
    store's circuit breaker (``RemoteStore.gauges``), the replica's view of whether L3 answers."""
    chunk_bytes = chunk_blocks * bytes_per_block
    return {"capacity_blocks": (g["capacity_bytes"] // max(1, chunk_bytes)) * chunk_blocks,
            "capacity_bytes": g["capacity_bytes"], "used_blocks": g["objects"] * chunk_blocks,
            "used_bytes": g["used_bytes"], "objects": g["objects"], "stored_bytes": g["used_bytes"],
            "store_objects": g["store_objects"], "store_used_bytes": g["store_used_bytes"],
            "corrupt_objects": g["corrupt"], "quarantined": g["quarantined"], "unavailable": g["unavailable"],
            "breaker_open": g["breaker_open"], "breaker_opens": g["breaker_opens"]}
