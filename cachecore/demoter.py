"""Demoter: L1's blocks written down to L2, by the write policy (:mod:`cachecore.writeback`).

- write-back and selective: it listens to L1's drops (``pool.listeners``) and writes an evicted
  block's bytes to L2 while its page still holds them. The evictions of one ``allocate`` go down
  in one batched copy right after it, before the new holder can write its pages.
- write-through: ``committed`` holds a request's newly committed blocks and copies them to L2 on a
  writer thread, then lets them go.
- ``copy``: the L1 blocks of a prefix that L2 lacks, copied whatever the policy (pins, prewarm).

Nothing of a retired revision goes down, and a write-through copy re-checks the flush fence before
its put (a flush since its request was admitted wins), so a flush stays flushed.

Collaborators: the engine's lock (the listener runs under it), L1, L2, the write policy, the flush
fence and the metrics.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from cachecore.writeback import Writer

if TYPE_CHECKING:
    from cachecore.block_pool import Block
    from cachecore.flush_fence import FlushFence
    from cachecore.metrics import CacheMetrics
    from cachecore.sequence import CachedSequence
    from cachecore.tiers.base import Tag
    from cachecore.tiers.device import DeviceStore
    from cachecore.tiers.host import HostStore
    from cachecore.writeback import WritePolicy


class Demoter:
    def __init__(self, *, lock: threading.RLock, l1: DeviceStore, l2: HostStore, policy: WritePolicy,
                 fence: FlushFence, metrics: CacheMetrics) -> None:
        self._lock = lock
        self._l1, self._l2 = l1, l2
        self._policy = policy
        self._fence = fence
        self._metrics = metrics
        self._writer = Writer() if policy.on_commit else None
        # Blocks L1 evicted during the allocation in progress, written to L2 in one copy right after it
        # (before anything can overwrite them); None outside ``allocate`` (then written one by one).
        self._demoting: list[tuple[Block, bytes, tuple, Tag]] | None = None
        l1.pool.listeners.append(self._on_drop)

    def allocate(self, n: int, owner: str) -> list[Block]:
        """``pool.allocate`` (under the lock) with the evicted blocks written down (by the policy) in
        one batch, while their pages still hold their bytes (the new holder writes only after this
        returns)."""
        self._demoting = []
        try:
            blocks = self._l1.pool.allocate(n, owner)
            batch = self._demoting
        finally:
            self._demoting = None
        if batch:
            kv = self._l1.read([b for b, _, _, _ in batch])
            self._count(self._l2.put_many([(key, tokens, tag) for _, key, tokens, tag in batch], kv))
        return blocks

    def _on_drop(self, block: Block, reason: str) -> None:
        """L1 listener (under the lock): write an evicted block's bytes to L2 by the write policy."""
        tag = block.tag
        if tag is None or not self._policy.on_evict(reason=reason, hits=block.hits):
            return
        if self._fence.retired(tag.model, tag.revision):
            return
        if self._demoting is not None:
            self._demoting.append((block, block.block_hash, block.token_ids, tag))
        elif self._l2.put(block.block_hash, block.token_ids, tag, self._l1.read([block])):
            self._count(1)

    def committed(self, seq: CachedSequence, new: list[Block]) -> None:
        """Under the lock, after ``seq`` registered ``new``: with write-through, hold them and copy them
        to L2 on the writer thread, then release them."""
        if not new or self._writer is None:
            return
        pool, gen = self._l1.pool, seq.flush_gen
        pool.touch(new)
        self._fence.hold(gen)
        entries = [(b.block_hash, b.token_ids, b.tag) for b in new]

        def job() -> None:
            try:
                kv = self._l1.read(new)
                with self._lock:
                    for (key, tokens, tag), page in zip(entries, kv, strict=True):
                        if not self._fence.stale(gen, tag) and self._l2.put(key, tokens, tag, page):
                            self._count(1)
            finally:
                with self._lock:
                    pool.free(new)
                    self._fence.leave(gen)

        self._writer.submit(job)

    def copy(self, hashes: list[bytes], tokens: list[int]) -> int:
        """Write the prefix's L1 blocks that L2 does not hold into L2 (one copy); how many were new."""
        with self._lock:
            pool = self._l1.pool
            blocks = [b for b in self._l1.match(hashes, tokens) if b.tag is not None
                      and not self._l2.contains(b.block_hash, b.token_ids)]
            if not blocks:
                return 0
            pool.touch(blocks)
            try:
                kv = self._l1.read(blocks)
                entries = [(b.block_hash, b.token_ids, b.tag) for b in blocks]
            finally:
                pool.free(blocks)
            stored = self._l2.put_many(entries, kv)
            self._count(stored)
            return stored

    def drain(self) -> None:
        """Wait until every write-through copy submitted so far has landed."""
        if self._writer is not None:
            self._writer.drain()

    def _count(self, n: int) -> None:
        tier = self._metrics.tier("l2")
        tier.demotions += n
        tier.bytes_in += n * self._l2.layout.bytes_per_block
