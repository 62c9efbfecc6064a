"""The tiers' hooks that publish KV events into an :class:`~cachecore.events.EventLog`.

:class:`PoolRecorder` turns one block pool's listener calls (L1's, L2's) into one batch per pool
operation; :class:`L3Recorder` turns the remote store's put/drop hooks into L3 events;
:func:`wire_engine` connects an engine's tiers. The hot path does no per-block work here beyond
appending a hash to a list.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from cachecore.events import TIERS, AllCleared, BlockRemoved, BlockStored, Event, EventLog

__all__ = ["DEFAULT_L3_CHUNKS", "L3Recorder", "PoolRecorder", "wire_engine"]

DEFAULT_L3_CHUNKS = 4096  # L3 chunks one replica keeps vouching for


class PoolRecorder:
    """One pool-backed tier's events: the pool's drop announcements (``pool.listeners``) and the
    ``stored`` calls of whoever caches blocks in it become one batch per pool operation, published
    when the pool says the operation is over (``pool.batch_listeners``; a ``pool.batch()`` block
    makes one operation of several). A flush that leaves the tier empty is announced as
    ``AllCleared(tier)``.

    Called under the lock that guards the pool (the engine's for L1, the host store's for L2), which
    also guards this recorder's pending lists."""

    def __init__(self, log: EventLog, tier: str, pool) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.log = log
        self.tier = tier
        self.pool = pool
        self._removed: dict[str, list[bytes]] = {}
        self._stored: list[bytes] = []
        pool.listeners.append(self.on_drop)
        pool.batch_listeners.append(self.flush)

    def on_drop(self, block, reason: str) -> None:
        pending = self._removed.get(reason)
        if pending is None:
            self._removed[reason] = [block.block_hash]
        else:
            pending.append(block.block_hash)

    def stored(self, hashes: Iterable[bytes]) -> None:
        """These blocks were newly cached in the tier (published at once outside a ``pool.batch()``)."""
        self._stored.extend(hashes)
        if not self.pool.in_batch:
            self.flush()

    def flush(self) -> None:
        if not self._removed and not self._stored:
            return
        removed, stored = self._removed, self._stored
        self._removed, self._stored = {}, []
        if list(removed) == ["flushed"] and self.pool.num_cached == len(stored):
            events: list[Event] = [AllCleared(self.tier)]
        else:
            events = [BlockRemoved(self.tier, tuple(hs), reason) for reason, hs in removed.items()]
        if stored:
            events.append(BlockStored(self.tier, tuple(stored)))
        self.log.publish(*events)


class L3Recorder:
    """L3's events. An L3 object is a chunk of consecutive blocks named by its last block's hash, so
    ``BlockStored("l3")`` lists every block of a chunk this replica wrote, and a removal of the chunk
    (by name) is announced with the hashes remembered for it. The replica vouches for at most
    ``max_chunks`` chunks (the most recently written); older ones are announced ``"untracked"``.
    Chunks this replica did not write (another replica's, or its own before a restart) are never
    announced by it. Thread-safe (its own lock, taken outside the store's)."""

    def __init__(self, log: EventLog, *, max_chunks: int = DEFAULT_L3_CHUNKS) -> None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ValueError(f"max_chunks must be an int >= 1, got {max_chunks!r}")
        self.log = log
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def attach(self, store) -> None:
        store.put_listeners.append(self.on_put)
        store.drop_listeners.append(self.on_drop)

    def on_put(self, hashes: Sequence[bytes]) -> None:
        chunk = tuple(hashes)
        with self._lock:
            self._chunks[chunk[-1]] = chunk
            self._chunks.move_to_end(chunk[-1])
            old: list[bytes] = []
            while len(self._chunks) > self.max_chunks:
                old.extend(self._chunks.popitem(last=False)[1])
            self.log.publish(BlockRemoved("l3", tuple(old), "untracked"), BlockStored("l3", chunk))

    def on_drop(self, keys: Sequence[bytes], reason: str) -> None:
        with self._lock:
            gone: list[bytes] = []
            for key in keys:
                chunk = self._chunks.pop(key, None)
                if chunk is not None:
                    gone.extend(chunk)
            self.log.publish(BlockRemoved("l3", tuple(gone), reason))


def wire_engine(log: EventLog, engine) -> PoolRecorder:
    """Connect ``log`` to an engine's tiers (L1 device store, L2 host store, L3 remote store when
    present); returns L1's recorder."""
    l1 = PoolRecorder(log, "l1", engine.pool)
    engine.l1.stored_listeners.append(l1.stored)
    if engine.l2 is not None:
        engine.l2.stored_listeners.append(PoolRecorder(log, "l2", engine.l2.pool).stored)
    if engine.l3 is not None:
        L3Recorder(log).attach(engine.l3)
    return l1
