"""KVTransfer: the KV API for external engines, ``lookup / store / retrieve`` over L1 then L2 (the
:class:`~cachecore.tiers.base.PrefixCache` contract that ``CacheEngine`` offers).

Hashes are computed outside the lock a batch at a time and hashing stops at the first miss, so a long
token list neither stalls other requests nor costs more than its hit. ``store`` goes through the
engine's request path (``admit`` -> ``finish_loads`` -> ``mark_computed`` -> ``commit`` ->
``release``), so an upload is admitted, fenced, limited and counted like a request; it never reaches
L3.

Collaborators: the engine's lock, L1, L2 (may be None), the metrics and the request path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from cachecore.errors import InvalidKV
from cachecore.hashing import chain_hashes
from cachecore.tiers.base import Retrieved

if TYPE_CHECKING:
    from cachecore.block_pool import Block
    from cachecore.metrics import CacheMetrics
    from cachecore.namespace import Namespace
    from cachecore.sequence import CachedSequence
    from cachecore.tiers.device import DeviceStore
    from cachecore.tiers.host import HostStore

_HASH_BATCH = 16  # blocks hashed per lock round trip


class RequestPath(Protocol):
    """What ``store`` needs of the engine: a request's life."""

    def admit(self, ns: Namespace, tokens: Sequence[int], **kw) -> CachedSequence: ...
    def finish_loads(self, seq: CachedSequence) -> int: ...
    def mark_computed(self, seq: CachedSequence, upto: int) -> None: ...
    def commit(self, seq: CachedSequence) -> int: ...
    def release(self, seq: CachedSequence) -> None: ...


class KVTransfer:
    def __init__(self, *, lock: threading.RLock, l1: DeviceStore, l2: HostStore | None, metrics: CacheMetrics,
                 requests: RequestPath) -> None:
        self._lock = lock
        self._l1, self._l2 = l1, l2
        self._metrics = metrics
        self._requests = requests
        self._layout = l1.layout
        self._bs = l1.layout.block_size

    def _walk(self, ns: Namespace, tokens: Sequence[int], request_salt: bytes, *, hold: bool
              ) -> tuple[list[Block], list[tuple[bytes, tuple]]]:
        """The contiguous hit of ``tokens``: L1 blocks, then the L2 items after them. ``hold``: take a
        reference on each L1 block (the caller frees them)."""
        bs, pool = self._bs, self._l1.pool
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
                        block = None if lower else pool.get_cached(h, block_tokens)
                        if block is not None:
                            if hold:
                                pool.touch([block])
                            hits.append(block)
                        elif self._l2 is not None and self._l2.contains(h, block_tokens):
                            lower.append((h, block_tokens))
                        else:
                            return hits, lower
                parent = hashes[-1]
        except BaseException:
            if hold and hits:
                with self._lock:
                    pool.free(hits)
            raise
        return hits, lower

    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        hits, lower = self._walk(ns, list(tokens), request_salt, hold=False)
        return (len(hits) + len(lower)) * self._bs

    def store(self, ns: Namespace, tokens: Sequence[int], kv: torch.Tensor, *, owner: str, request_salt: bytes = b"",
              model: str = "", revision: str = "") -> int:
        tokens = list(tokens)
        bs, requests = self._bs, self._requests
        n_blocks = len(tokens) // bs
        if kv.dim() != 1 + len(self._layout.page_shape) or kv.shape[0] < n_blocks:
            raise InvalidKV(f"expected kv of shape [{n_blocks}, *{tuple(self._layout.page_shape)}]")
        if n_blocks == 0:
            return 0
        seq = requests.admit(
            ns, tokens[: n_blocks * bs], owner=owner, model=model, revision=revision,
            request_salt=request_salt, recompute_last=False, persist=False,  # uploads never reach L3
        )
        try:
            have = requests.finish_loads(seq) // bs
            todo = seq.blocks[have:n_blocks]
            if todo:
                self._l1.write(todo, kv[have:n_blocks])
            requests.mark_computed(seq, n_blocks * bs)
            return requests.commit(seq)
        finally:
            requests.release(seq)

    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        tokens = list(tokens)
        bs, layout = self._bs, self._layout
        t0 = time.perf_counter()
        hits, lower = self._walk(ns, tokens, request_salt, hold=True)
        try:
            parts = [self._l1.read(hits)] if hits else []
        finally:
            with self._lock:
                self._l1.pool.free(hits)
        if lower:
            fetched = self._l2.get(lower)
            if fetched.kv.shape[0]:
                parts.append(fetched.kv.to(self._l1.pages.device))
        kv = torch.cat(parts) if parts else torch.empty((0, *layout.page_shape), dtype=layout.torch_dtype)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[: kv.shape[0] * bs] = True
        with self._lock:
            self._metrics.observe_load("l1", tokens=len(hits) * bs, nbytes=len(hits) * layout.bytes_per_block,
                                       seconds=time.perf_counter() - t0)
        return Retrieved(kv, mask)
