"""The engine's writes down the hierarchy: L1 evictions written back to L2 (batched per
allocation), write-through copies to L2 after commit, and L3 chunks written in the background once
a request has committed them; part of :class:`cachecore.engine.CacheEngine`.

Every background write holds its L1 blocks until it has read them, and re-checks the flushes that
happened since its request was admitted, before and after writing, so a flush stays flushed.
"""

from __future__ import annotations

from cachecore.block_pool import Block
from cachecore.sequence import CachedSequence

MAX_L3_BACKLOG = 64  # chunks waiting for the L3 writer (each holds its L1 blocks until written)


class WritesMixin:
    """Mixed into ``CacheEngine``; uses its lock, pool, stores, policies and metrics."""

    def _allocate(self, n: int, owner: str) -> list[Block]:
        """``pool.allocate`` with the evicted blocks written down (by the policy) in one batch, while
        their pages still hold their bytes (the new holder writes only after this returns)."""
        if self.l2 is None:
            return self.pool.allocate(n, owner)
        self._demoting = []
        try:
            blocks = self.pool.allocate(n, owner)
            batch = self._demoting
        finally:
            self._demoting = None
        if batch:
            kv = self.l1.read([b for b, _, _, _ in batch])
            stored = self.l2.put_many([(key, tokens, tag) for _, key, tokens, tag in batch], kv)
            self._count_demotion(stored)
        return blocks

    def _on_l1_drop(self, block: Block, reason: str) -> None:
        """L1 listener (under the lock): write an evicted block's bytes to L2 by the write policy."""
        tag = block.tag
        if tag is None or not self.write_policy.on_evict(reason=reason, hits=block.hits):
            return
        if (tag.model, tag.revision) in self._retired:
            return
        if self._demoting is not None:
            self._demoting.append((block, block.block_hash, block.token_ids, tag))
        elif self.l2.put(block.block_hash, block.token_ids, tag, self.l1.read([block])):
            self._count_demotion(1)

    def _count_demotion(self, n: int) -> None:
        tier = self.metrics.tier("l2")
        tier.demotions += n
        tier.bytes_in += n * self.layout.bytes_per_block

    def _write_through(self, blocks: list[Block], gen: int) -> None:
        """Hold ``blocks`` and copy them to L2 on the writer thread, then release them."""
        self.pool.touch(blocks)
        self._gens_in_use[gen] += 1
        entries = [(b.block_hash, b.token_ids, b.tag) for b in blocks]

        def job() -> None:
            try:
                kv = self.l1.read(blocks)
                with self._lock:
                    for (key, tokens, tag), page in zip(entries, kv, strict=True):
                        if not self._flushed_since(gen, tag) and (tag.model, tag.revision) not in self._retired \
                                and self.l2.put(key, tokens, tag, page):
                            self._count_demotion(1)
            finally:
                with self._lock:
                    self.pool.free(blocks)
                    self._release_gen(gen)

        self._writer.submit(job)

    def _write_chunks(self, seq: CachedSequence) -> None:
        """Under the lock: submit every L3 chunk of ``seq`` that is now wholly registered and not
        written yet. Its blocks stay held until the writer thread has sealed and stored them; a flush
        that matches the chunk while it is being written deletes it again afterwards. Each chunk carries
        the request's retention as its own expiry (see :mod:`cachecore.tiers.remote`)."""
        cb, bs = self.l3.chunk_blocks, self.block_size
        while (seq.l3_chunks + 1) * cb <= seq.num_registered:
            if self._l3_writer.backlog() >= MAX_L3_BACKLOG:  # L3 is slower than traffic: do not pin L1 for it
                self.metrics.tier("l3").skipped_writes += (seq.num_registered // cb) - seq.l3_chunks
                seq.l3_chunks = seq.num_registered // cb
                return
            c = seq.l3_chunks
            seq.l3_chunks += 1
            blocks = seq.blocks[c * cb : (c + 1) * cb]
            hashes = seq.hashes[c * cb : (c + 1) * cb]
            tokens = seq.tokens[c * cb * bs : (c + 1) * cb * bs]
            self.pool.touch(blocks)
            gen, tag, retention = seq.flush_gen, seq.tag, seq.retention_seconds
            self._gens_in_use[gen] += 1

            def job(blocks=blocks, hashes=hashes, tokens=tokens, gen=gen, tag=tag, retention=retention) -> None:
                try:
                    kv = self.l1.read(blocks).cpu()
                    with self._lock:
                        if self._flushed_since(gen, tag) or (tag.model, tag.revision) in self._retired:
                            return
                    if self.l3.put_chunk(hashes, tokens, tag, kv, retention_seconds=retention):
                        with self._lock:
                            undo = self._flushed_since(gen, tag) or (tag.model, tag.revision) in self._retired
                            tier = self.metrics.tier("l3")
                            tier.demotions += cb
                            tier.bytes_in += cb * self.layout.bytes_per_block
                        if undo:  # a flush ran while this chunk was being written: it must stay flushed
                            self.l3.delete_chunk(tag, hashes[-1])
                finally:
                    with self._lock:
                        self.pool.free(blocks)
                        self._release_gen(gen)

            self._l3_writer.submit(job)

    def drain_writes(self) -> None:
        """Wait until every background write submitted so far has landed (tests, benchmarks)."""
        if self._writer is not None:
            self._writer.drain()
        if self._l3_writer is not None:
            self._l3_writer.drain()
