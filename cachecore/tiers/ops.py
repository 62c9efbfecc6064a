"""The tiers as the orchestrator's operations see them: one contract, :class:`TierOps`, over L1 and L2
(:class:`PooledOps`: a block pool in memory) and L3 (:class:`RemoteOps`: chunk objects in a backend),
so ``CacheEngine`` loops over its tiers to flush, count, weigh, check and report them.

A ``local`` tier is memory only: its operations run under the engine's lock. The others do I/O and
run outside it. A flush or count selects blocks by their tag (``match``); L3 names its objects, so it
takes the same selection by name (``scope``: ``{"tenant"?, "model"?, "revision"?, "key_version"?}``)
and is left alone when there is none. A report's ``deployment`` ``(model, revision)`` narrows L3's
figures to that deployment revision's objects (the store is shared).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from cachecore.tiers.base import Tag
from cachecore.tiers.remote import l3_figures

if TYPE_CHECKING:
    from cachecore.tiers.device import DeviceStore
    from cachecore.tiers.host import HostStore
    from cachecore.tiers.remote import RemoteStore


class Flushed(NamedTuple):
    """What a flush dropped from one tier: ``entries`` as the tier counts them (blocks; L3: chunk
    objects), the ``blocks`` they held, and the ``nbytes`` freed in a backend (0 for a pool in
    memory, whose pages stay allocated)."""

    entries: int
    blocks: int
    nbytes: int


class TierOps(ABC):
    """One tier's operations. ``flush`` and ``count`` may raise ``BackendUnavailable`` (a remote
    tier); the others never raise for the tier's state."""

    name: str
    local: bool

    @abstractmethod
    def flush(self, match: Callable[[Tag], bool], scope: dict | None) -> Flushed:
        """Drop every cached block (object) the selection names."""

    @abstractmethod
    def count(self, match: Callable[[Tag], bool], scope: dict | None) -> int:
        """Cached blocks the selection names (L3: its objects, a chunk each)."""

    @abstractmethod
    def set_weight(self, owner: str, weight: int | None) -> None:
        """``owner``'s fair-share weight in this tier (None: 1). ``ValueError`` unless an int >= 1."""

    @abstractmethod
    def figures(self, deployment: tuple[str, str] | None) -> tuple[dict, dict[str, int]]:
        """The tier's row fields for the snapshot (capacity, use...) and its resident blocks per owner."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the invariants the engine keeps in memory for this tier."""


class PooledOps(TierOps):
    """L1 (``DeviceStore``) or L2 (``HostStore``)."""

    local = True

    def __init__(self, store: DeviceStore | HostStore) -> None:
        self.store = store
        self.name = store.name

    def flush(self, match: Callable[[Tag], bool], scope: dict | None) -> Flushed:
        n = self.store.delete(match)
        return Flushed(n, n, 0)

    def count(self, match: Callable[[Tag], bool], scope: dict | None) -> int:
        return self.store.count(match)

    def set_weight(self, owner: str, weight: int | None) -> None:
        self.store.pool.set_weight(owner, 1 if weight is None else weight)

    def figures(self, deployment: tuple[str, str] | None) -> tuple[dict, dict[str, int]]:
        g = self.store.gauges()
        row = {"capacity_blocks": g["total"], "used_blocks": g["used"], "evictions": g["evictions"]}
        if "rejected" in g:  # a store that may refuse a put (L2)
            row["rejected_puts"] = g["rejected"]
        return row, self.store.resident()

    def check_integrity(self) -> None:
        self.store.check_integrity()


class RemoteOps(TierOps):
    """L3 (``RemoteStore``). ``drain``: waits for the L3 writes queued so far, which a flush lets land
    (the matching ones skip themselves) before it deletes, so none of them lands after the delete."""

    local = False

    def __init__(self, store: RemoteStore, *, drain: Callable[[], None], bytes_per_block: int) -> None:
        self.store = store
        self.name = "l3"
        self._drain = drain
        self._bpb = bytes_per_block

    def flush(self, match: Callable[[Tag], bool], scope: dict | None) -> Flushed:
        if scope is None:
            return Flushed(0, 0, 0)
        self._drain()
        n, nbytes = self.store.delete_scope(**scope)
        return Flushed(n, n * self.store.chunk_blocks, nbytes)

    def count(self, match: Callable[[Tag], bool], scope: dict | None) -> int:
        return self.store.count_scope(**scope)[0] if scope is not None else 0

    def set_weight(self, owner: str, weight: int | None) -> None:
        self.store.set_weight(owner, weight)

    def figures(self, deployment: tuple[str, str] | None) -> tuple[dict, dict[str, int]]:
        row = l3_figures(self.store.gauges(deployment), self.store.chunk_blocks, self._bpb)
        resident = {t: b // self._bpb for t, b in self.store.usage_by_tenant(scope=deployment).items()}
        return row, resident

    def check_integrity(self) -> None:
        """Nothing: L3's accounting is the store's own (``RemoteStore.check_integrity``), not the engine's."""
