"""ChunkWriter: a request's L3 chunks written in the background as soon as it has committed them.

L3 objects are chunks of consecutive blocks (:mod:`cachecore.tiers.remote`); after each commit of a
request that may persist, ``committed`` submits every chunk it now holds wholly and has not written
yet (write-through: what a restart keeps), together: one job, one ``RemoteStore.put_chunks`` (one
existence probe and one batched conditional write for the set). Each job holds its L1 blocks until
it has read them and re-checks the flush fence before and after its put: chunks matched by a flush
(or of a revision retired) since their request was admitted are not written, or are deleted again
once written. Past ``MAX_L3_BACKLOG`` chunks waiting, new chunks are skipped (counted), so a slow L3
never pins L1.

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
        self._waiting = 0  # chunks submitted and not landed yet (under the lock)

    def committed(self, seq: CachedSequence, new: list[Block]) -> None:
        """Under the lock, after a commit of ``seq``: submit every L3 chunk of it that is now wholly
        registered and not written yet (``new`` is not needed: chunks follow ``seq.num_registered``),
        unless it may not persist, as one job (one ``put_chunks``: the set's writes go together).
        Each chunk carries the request's retention as its own expiry."""
        if not seq.tag.persist:
            return
        cb, bs = self._l3.chunk_blocks, self._l1.layout.block_size
        first, whole = seq.l3_chunks, seq.num_registered // cb
        if whole <= first:
            return
        n = min(whole - first, max(0, MAX_L3_BACKLOG - self._waiting))
        if n < whole - first:  # L3 is slower than traffic: do not pin L1 for it
            self._metrics.tier("l3").skipped_writes += whole - first - n
        seq.l3_chunks = whole
        if n == 0:
            return
        end = first + n
        blocks = seq.blocks[first * cb : end * cb]
        self._l1.pool.touch(blocks)
        self._fence.hold(seq.flush_gen)
        self._waiting += n
        self._writer.submit(self._job(blocks, seq.hashes[first * cb : end * cb],
                                      seq.tokens[first * cb * bs : end * cb * bs], seq))

    def _job(self, blocks: list[Block], hashes: list[bytes], tokens: list[int], seq: CachedSequence):
        gen, tag, retention = seq.flush_gen, seq.tag, seq.retention_seconds
        cb, bpb = self._l3.chunk_blocks, self._l1.layout.bytes_per_block
        ct = cb * self._l1.layout.block_size
        n = len(blocks) // cb

        def job() -> None:
            try:
                kv = self._l1.read(blocks).cpu()
                if self._fence.stale(gen, tag):
                    return
                chunks = [(hashes[c * cb : (c + 1) * cb], tokens[c * ct : (c + 1) * ct], kv[c * cb : (c + 1) * cb])
                          for c in range(n)]
                written = [c for c, ok in enumerate(self._l3.put_chunks(chunks, tag, retention_seconds=retention))
                           if ok]
                if written:
                    with self._lock:
                        undo = self._fence.stale(gen, tag)
                        tier = self._metrics.tier("l3")
                        tier.demotions += cb * len(written)
                        tier.bytes_in += cb * bpb * len(written)
                    if undo:  # a flush ran while these chunks were being written: they must stay flushed
                        for c in written:
                            self._l3.delete_chunk(tag, hashes[(c + 1) * cb - 1])
            finally:
                with self._lock:
                    self._l1.pool.free(blocks)
                    self._fence.leave(gen)
                    self._waiting -= n

        return job

    def writing(self) -> bool:
        """Whether chunks are being sealed and written (fsynced, on the file backend) right now."""
        return self._writer.busy()

    def drain(self) -> None:
        """Wait until every chunk submitted so far has landed (or skipped itself)."""
        self._writer.drain()
