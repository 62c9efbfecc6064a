"""ChunkWriter: a request's L3 chunks written in the background as soon as it has committed them.

L3 objects are chunks of consecutive blocks (:mod:`cachecore.tiers.remote`); after each commit of a
request that may persist, ``committed`` submits every chunk it now holds wholly and has not written
yet (write-through: what a restart keeps). Each write holds its L1 blocks until it has read them and
re-checks the flush fence before and after its put: a chunk matched by a flush (or of a revision
retired) since its request was admitted is not written, or is deleted again once written. Past
``MAX_L3_BACKLOG`` chunks waiting, new chunks are skipped (counted), so a slow L3 never pins L1.

Collaborators: the engine's lock, L1 (reads, holds), the L3 store, the flush fence and the metrics.
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
    from cachecore.tiers.device import DeviceStore
    from cachecore.tiers.remote import RemoteStore

MAX_L3_BACKLOG = 64  # chunks waiting for the L3 writer (each holds its L1 blocks until written)


class ChunkWriter:
    def __init__(self, *, lock: threading.RLock, l1: DeviceStore, l3: RemoteStore, fence: FlushFence,
                 metrics: CacheMetrics) -> None:
        self._lock = lock
        self._l1, self._l3 = l1, l3
        self._fence = fence
        self._metrics = metrics
        self._writer = Writer("strata-l3-writer")

    def committed(self, seq: CachedSequence, new: list[Block]) -> None:
        """Under the lock, after a commit of ``seq``: submit every L3 chunk of it that is now wholly
        registered and not written yet (``new`` is not needed: chunks follow ``seq.num_registered``),
        unless it may not persist. Each chunk carries the request's retention as its own expiry."""
        if not seq.tag.persist:
            return
        pool, cb, bs = self._l1.pool, self._l3.chunk_blocks, self._l1.layout.block_size
        while (seq.l3_chunks + 1) * cb <= seq.num_registered:
            if self._writer.backlog() >= MAX_L3_BACKLOG:  # L3 is slower than traffic: do not pin L1 for it
                self._metrics.tier("l3").skipped_writes += (seq.num_registered // cb) - seq.l3_chunks
                seq.l3_chunks = seq.num_registered // cb
                return
            c = seq.l3_chunks
            seq.l3_chunks += 1
            blocks = seq.blocks[c * cb : (c + 1) * cb]
            pool.touch(blocks)
            self._fence.hold(seq.flush_gen)
            self._writer.submit(self._job(blocks, seq.hashes[c * cb : (c + 1) * cb],
                                          seq.tokens[c * cb * bs : (c + 1) * cb * bs], seq))

    def _job(self, blocks: list[Block], hashes: list[bytes], tokens: list[int], seq: CachedSequence):
        gen, tag, retention = seq.flush_gen, seq.tag, seq.retention_seconds
        cb, bpb = self._l3.chunk_blocks, self._l1.layout.bytes_per_block

        def job() -> None:
            try:
                kv = self._l1.read(blocks).cpu()
                if self._fence.stale(gen, tag):
                    return
                if self._l3.put_chunk(hashes, tokens, tag, kv, retention_seconds=retention):
                    with self._lock:
                        undo = self._fence.stale(gen, tag)
                        tier = self._metrics.tier("l3")
                        tier.demotions += cb
                        tier.bytes_in += cb * bpb
                    if undo:  # a flush ran while this chunk was being written: it must stay flushed
                        self._l3.delete_chunk(tag, hashes[-1])
            finally:
                with self._lock:
                    self._l1.pool.free(blocks)
                    self._fence.leave(gen)

        return job

    def drain(self) -> None:
        """Wait until every chunk submitted so far has landed (or skipped itself)."""
        self._writer.drain()
