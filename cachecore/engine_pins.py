"""NamedCaches: which tiers hold a prefix, soft pins on it, and deleting it from every tier (what
``CacheEngine.resident / pin / commit_to_l2 / drop`` do); the lower-tier helpers are shared with the
vLLM tier service, ``workers.kv_tiers``.

A prefix is the full blocks of ``tokens`` under ``ns`` (and the request salt), keyed by the same
chain hashes a completion of that prompt computes, so a later completion hits what is pinned.

- ``resident``: tokens of the contiguous full-block prefix each tier holds (L1 and L2 by index, L3
  by whole chunks, a metadata answer as ``probe`` gives).
- ``pin``: soft pins (``BlockPool.pin`` in L1 and L2, ``RemoteStore.pin`` for the L3 chunks) by
  hash until a unix time: the blocks are evicted after their owner's unpinned ones, never at the
  expense of another tenant's fair share, and the pins lapse by themselves. Blocks in L1 but not
  in L2 are copied to L2 first, so the pin holds in L2 whatever the write policy.
- ``drop``: the prefix's blocks leave L1 (free ones become plain free blocks; blocks a running
  request holds stay usable by it but leave the index), L2, and L3 (the chunk objects covering
  them are deleted from the backend), and their pins go.

Collaborators: the engine's lock, L1, L2 and L3 (each lower one may be None), the demoter (L1 to L2
copies; None without L2), the metrics and the engine's ``drain_writes``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cachecore.hashing import chain_hashes
from cachecore.tiers.base import Tag

if TYPE_CHECKING:
    from cachecore.demoter import Demoter
    from cachecore.metrics import CacheMetrics
    from cachecore.namespace import Namespace
    from cachecore.tiers.device import DeviceStore
    from cachecore.tiers.host import HostStore
    from cachecore.tiers.remote import RemoteStore


def _items(hashes: Sequence[bytes], tokens: Sequence[int], bs: int) -> list[tuple[bytes, tuple]]:
    return [(h, tuple(tokens[i * bs : (i + 1) * bs])) for i, h in enumerate(hashes)]


def lower_resident(l2: HostStore | None, l3: RemoteStore | None, hashes: Sequence[bytes], tokens: Sequence[int],
                   tag: Tag, bs: int) -> dict[str, int]:
    """Tokens of the contiguous prefix of ``hashes`` held in L2 and in L3 (``{"l2", "l3"}``)."""
    n2 = l2.prefix(_items(hashes, tokens, bs)) if l2 is not None else 0
    n3 = l3.probe(hashes, tag) if l3 is not None else 0
    return {"l2": n2 * bs, "l3": n3 * bs}


def lower_pin(l2: HostStore | None, l3: RemoteStore | None, hashes: Sequence[bytes], until: float | None) -> None:
    """Pin (``until`` None: unpin) the blocks of ``hashes`` in L2 and their whole chunks in L3."""
    if l2 is not None:
        l2.pin(hashes, until)
    if l3 is not None:
        l3.pin(l3.chunk_keys(hashes), until)


def lower_drop(l2: HostStore | None, l3: RemoteStore | None, hashes: Sequence[bytes], tag: Tag) -> dict:
    """Delete the blocks of ``hashes`` from L2 and the L3 chunks covering them, with their pins:
    ``{"l2": blocks, "l3": objects, "l3_bytes"}``. Raises ``BackendUnavailable`` (L2 is done by then)."""
    n2 = l2.drop_keys(hashes) if l2 is not None else 0
    n3 = b3 = 0
    if l3 is not None:
        n3, b3 = l3.delete_keys(tag, l3.chunk_keys(hashes))
    return {"l2": n2, "l3": n3, "l3_bytes": b3}


class NamedCaches:
    def __init__(self, *, lock: threading.RLock, l1: DeviceStore, l2: HostStore | None, l3: RemoteStore | None,
                 demoter: Demoter | None, metrics: CacheMetrics, drain: Callable[[], None]) -> None:
        self._lock = lock
        self._l1, self._l2, self._l3 = l1, l2, l3
        self._demoter = demoter
        self._metrics = metrics
        self._drain = drain
        self._bs = l1.layout.block_size

    def _prefix_hashes(self, ns: Namespace, tokens: Sequence[int], request_salt: bytes) -> tuple[list, list]:
        tokens = list(tokens)
        n = len(tokens) // self._bs * self._bs
        return chain_hashes(ns, tokens[:n], self._bs, request_salt=request_salt), tokens

    def resident(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"", owner: str = "",
                 model: str = "", revision: str = "") -> dict[str, int]:
        """Tokens of the full-block prefix of ``tokens`` held in each tier: ``{"l1", "l2", "l3"}``
        (L3 needs ``owner``, ``model`` and ``revision``: its objects are named by them)."""
        hashes, tokens = self._prefix_hashes(ns, tokens, request_salt)
        with self._lock:
            n1 = len(self._l1.match(hashes, tokens))
        tag = Tag(owner, model, revision, ns.digest)
        lower = lower_resident(self._l2, self._l3 if owner else None, hashes, tokens, tag, self._bs)
        return {"l1": n1 * self._bs, **lower}

    def pin(self, ns: Namespace, tokens: Sequence[int], until: float | None, *, request_salt: bytes = b"",
            owner: str = "", model: str = "", revision: str = "") -> dict[str, int]:
        """Soft-pin the full-block prefix of ``tokens`` in L1, L2 and L3 until ``until`` (unix time;
        None: unpin), copying its L1 blocks that L2 lacks into L2 first. Returns ``resident``."""
        hashes, tokens = self._prefix_hashes(ns, tokens, request_salt)
        if until is not None and self._demoter is not None:
            self._demoter.copy(hashes, tokens)
        with self._lock:
            if until is None:
                self._l1.pool.unpin(hashes)
            else:
                self._l1.pool.pin(hashes, until)
        lower_pin(self._l2, self._l3, hashes, until)
        return self.resident(ns, tokens, request_salt=request_salt, owner=owner, model=model, revision=revision)

    def commit_to_l2(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"", owner: str = "",
                     model: str = "", revision: str = "") -> dict[str, int]:
        """Copy the full-block prefix of ``tokens`` that L1 holds and L2 lacks into L2, whatever the
        write policy (a prewarm is committed to L2 before it answers). Returns ``resident``."""
        hashes, tokens = self._prefix_hashes(ns, tokens, request_salt)
        if self._demoter is not None:
            self._demoter.copy(hashes, tokens)
        return self.resident(ns, tokens, request_salt=request_salt, owner=owner, model=model, revision=revision)

    def drop(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"", owner: str = "",
             model: str = "", revision: str = "") -> dict:
        """Delete the full-block prefix of ``tokens`` from L1, L2 and (with ``owner``, ``model``,
        ``revision``) the L3 objects covering it, and remove its pins. Blocks a running request holds
        stay usable by it but leave the index. Writes queued before the call land (and are deleted)
        first. Returns ``{"tiers": {"l1": blocks, "l2": blocks, "l3": objects}, "bytes", "l3_bytes"}``.
        Idempotent. Raises ``BackendUnavailable`` when L3 could not be reached (L1 and L2 are done)."""
        hashes, _ = self._prefix_hashes(ns, tokens, request_salt)
        self._drain()
        l3 = self._l3
        with self._lock:
            self._l1.pool.unpin(hashes)
            n1 = self._l1.pool.drop_hashes(hashes)
            tag = Tag(owner, model, revision, ns.digest)
            lower = lower_drop(self._l2, None, hashes, tag)
            self._metrics.flushed_blocks += n1 + lower["l2"]
        if l3 is not None and owner:
            lower["l3"], lower["l3_bytes"] = l3.delete_keys(tag, l3.chunk_keys(hashes))
        if l3 is not None and not owner:
            l3.pin(l3.chunk_keys(hashes), None)
        bpb = self._l1.layout.bytes_per_block
        return {"tiers": {"l1": n1, "l2": lower["l2"], "l3": lower["l3"]},
                "bytes": (n1 + lower["l2"]) * bpb + lower["l3_bytes"], "l3_bytes": lower["l3_bytes"]}
