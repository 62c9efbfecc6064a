"""The orchestrator's public ``lookup / store / retrieve`` (the KV API for external engines), over L1
then L2; part of :class:`cachecore.engine.CacheEngine`.

Hashes are computed outside the lock a batch at a time and hashing stops at the first miss, so a
long token list neither stalls other requests nor costs more than its hit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cachecore.block_pool import Block
from cachecore.errors import InvalidKV
from cachecore.hashing import chain_hashes
from cachecore.namespace import Namespace
from cachecore.tiers.base import Retrieved

_HASH_BATCH = 16  # blocks hashed per lock round trip


class KVApiMixin:
    """Mixed into ``CacheEngine``; uses its lock, pool, stores, admit/commit and metrics."""

    def _walk(self, ns: Namespace, tokens: Sequence[int], request_salt: bytes, *, hold: bool
              ) -> tuple[list[Block], list[tuple[bytes, tuple]]]:
        """The contiguous hit of ``tokens``: L1 blocks, then the L2 items after them. Hashes are
        computed outside the lock a batch at a time and hashing stops at the first miss, so a long
        token list neither stalls other requests nor costs more than its hit. ``hold``: take a
        reference on each L1 block (the caller frees them)."""
        bs = self.block_size
        hits: list[Block] = []
        lower: list[tuple[bytes, tuple]] = []
        parent = None
        try:
            for start in range(0, len(tokens) - bs + 1, bs * _HASH_BATCH):
                part = tokens[start : start + bs * _HASH_BATCH]
                hashes = chain_hashes(ns, part, bs, request_salt=request_salt, parent=parent)
                with self._lock:
                    for i, h in enumerate(hashes):
                        block_tokens = tuple(part[i * bs : (i + 1) * bs])
                        block = None if lower else self.pool.get_cached(h, block_tokens)
                        if block is not None:
                            if hold:
                                self.pool.touch([block])
                            hits.append(block)
                        elif self.l2 is not None and self.l2.contains(h, block_tokens):
                            lower.append((h, block_tokens))
                        else:
                            return hits, lower
                parent = hashes[-1]
        except BaseException:
            if hold and hits:
                with self._lock:
                    self.pool.free(hits)
            raise
        return hits, lower

    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        hits, lower = self._walk(ns, list(tokens), request_salt, hold=False)
        return (len(hits) + len(lower)) * self.block_size

    def store(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        kv: torch.Tensor,
        *,
        owner: str,
        request_salt: bytes = b"",
        model: str = "",
        revision: str = "",
    ) -> int:
        tokens = list(tokens)
        n_blocks = len(tokens) // self.block_size
        if kv.dim() != 1 + len(self.layout.page_shape) or kv.shape[0] < n_blocks:
            raise InvalidKV(f"expected kv of shape [{n_blocks}, *{tuple(self.layout.page_shape)}]")
        if n_blocks == 0:
            return 0
        seq = self.admit(
            ns, tokens[: n_blocks * self.block_size], owner=owner, model=model, revision=revision,
            request_salt=request_salt, recompute_last=False, persist=False,  # uploads never reach L3
        )
        try:
            have = self.finish_loads(seq) // self.block_size
            todo = seq.blocks[have:n_blocks]
            if todo:
                self.l1.write(todo, kv[have:n_blocks])
            self.mark_computed(seq, n_blocks * self.block_size)
            return self.commit(seq)
        finally:
            self.release(seq)

    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        tokens = list(tokens)
        t0 = time.perf_counter()
        hits, lower = self._walk(ns, tokens, request_salt, hold=True)
        try:
            parts = [self.l1.read(hits)] if hits else []
        finally:
            with self._lock:
                self.pool.free(hits)
        if lower:
            fetched = self.l2.get(lower)
            if fetched.kv.shape[0]:
                parts.append(fetched.kv.to(self.pages.device))
        kv = torch.cat(parts) if parts else torch.empty((0, *self.layout.page_shape), dtype=self.layout.torch_dtype)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[: kv.shape[0] * self.block_size] = True
        with self._lock:
            self.metrics.observe_load("l1", tokens=len(hits) * self.block_size,
                                      nbytes=len(hits) * self.layout.bytes_per_block, seconds=time.perf_counter() - t0)
        return Retrieved(kv, mask)
