"""L1: the device pages (GPU HBM on a GPU node, a CPU tensor otherwise) and their block pool.

The bookkeeping (:class:`~cachecore.block_pool.BlockPool`: ref counts, index, fair-share eviction) and
the bytes (:class:`~cachecore.pages.KVPages`) stay apart; this store joins them under the hash-keyed
:class:`~cachecore.tiers.base.BlockStore` contract. Unlike the lower tiers, L1 is also where running
requests hold their blocks, so the orchestrator uses its pool directly for admit/release and
``register`` for commits and promotions; the contract methods here serve the KV API and tests.

What the orchestrator newly registers (``register``) is announced by ``stored_listeners``
(``listener(keys)``, once per call, inside the pool's batch of that call), as ``HostStore`` does.

Not separately locked: every call happens under the orchestrator's lock (passed in), which is an
``RLock`` so the contract methods can be called from inside it too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from cachecore.block_pool import Block, BlockPool
from cachecore.errors import OutOfBlocks
from cachecore.eviction.base import EvictionPolicy
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY
from cachecore.layout import KVLayout
from cachecore.pages import KVPages
from cachecore.tiers.base import Fetched, Tag
from cachecore.tiers.pooled import PooledStore


class DeviceStore(PooledStore):
    name = "l1"

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str,
                 lock: threading.RLock | None = None, *,
                 eviction_policy: EvictionPolicy | str = DEFAULT_EVICTION_POLICY) -> None:
        self.layout = layout
        self.pool = BlockPool(num_blocks, layout.block_size, eviction_policy)
        self.pages = KVPages(layout, num_blocks, torch.device(device))
        self._lock = lock or threading.RLock()
        self.stored_listeners: list[Callable[[list[bytes]], None]] = []

    # ------------------------------------------------------------------ what the orchestrator uses
    def match(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> list[Block]:
        """The indexed blocks of the contiguous prefix of ``hashes`` (no references taken)."""
        bs = self.layout.block_size
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        index = self.pool._index  # hot path: the pool's own get_cached, inlined
        out = []
        for i, h in enumerate(hashes):
            block = index.get(h)
            if block is None:
                break
            if block.token_ids != toks[i * bs : (i + 1) * bs]:
                self.pool.stats.collisions += 1
                break
            out.append(block)
        return out

    def register(self, blocks: Sequence[Block], keys: Sequence[bytes], tokens: Sequence[int], tag: Tag, *,
                 parent: bytes | None = None, links: Sequence[bytes] | None = None) -> list[Block]:
        """Cache held ``blocks`` under ``keys`` (block i holds ``tokens[i * block_size : (i + 1) *
        block_size]``), as one pool operation; returns the blocks newly cached, in order (a key
        already cached, a collision or the owner's cap leaves its block un-hashed, not returned) and
        announces their keys to ``stored_listeners``. ``parent``/``links``: see
        ``BlockPool.cache_blocks``."""
        with self._lock, self.pool.batch():
            new = self.pool.cache_blocks(blocks, keys, tokens, tag.owner, tag, parent=parent, links=links)
            if new and self.stored_listeners:
                stored = [b.block_hash for b in new]
                for listener in self.stored_listeners:
                    listener(stored)
        return new

    def read(self, blocks: Sequence[Block]) -> torch.Tensor:
        return self.pages.read_blocks(_ids([b.block_id for b in blocks]))

    def write(self, blocks: Sequence[Block], kv: torch.Tensor) -> None:
        self.pages.write_blocks(_ids([b.block_id for b in blocks]), kv.to(self.pages.device))

    # ------------------------------------------------------------------ contract
    def put(self, key: bytes, tokens: tuple[int, ...], tag: Tag, kv: torch.Tensor) -> bool:
        with self._lock:
            if self.pool.get_cached(key, tokens) is not None:
                return False
            try:
                (block,) = self.pool.allocate(1, tag.owner)
            except OutOfBlocks:
                return False
            try:
                self.write([block], kv.reshape(1, *self.layout.page_shape))
                kept = self.pool.cache(block, key, tokens, tag.owner, tag)
                return kept is block and block.block_hash is not None
            finally:
                self.pool.free([block])

    def get(self, items: Sequence[tuple[bytes, tuple[int, ...]]]) -> Fetched:
        with self._lock:
            blocks = []
            for key, tokens in items:
                block = self.pool.get_cached(key, tokens)
                if block is None:
                    break
                blocks.append(block)
            self.pool.hit(blocks)
        try:
            kv = self.read(blocks) if blocks else torch.empty((0, *self.layout.page_shape),
                                                               dtype=self.layout.torch_dtype)
        finally:
            with self._lock:
                self.pool.free(blocks)
        return Fetched(kv, None if len(blocks) == len(items) else "miss")

    def gauges(self) -> dict[str, int]:
        with self._lock:
            pool = self.pool
            return {"total": pool.num_blocks, "used": pool.num_cached, "protected": pool.num_in_use,
                    "evictable": pool.num_cached_free, "free": pool.num_free - pool.num_cached_free,
                    "bytes_per_block": self.layout.bytes_per_block, "evictions": pool.stats.evictions,
                    "duplicate_stores": pool.stats.duplicate_stores, "collisions": pool.stats.collisions,
                    "cap_rejections": pool.stats.cap_rejections,
                    "protected_evictions": pool.stats.protected_evictions}

    def check_integrity(self) -> None:
        with self._lock:
            self.pool.check_integrity()
            for block in self.pool._index.values():
                assert block.tag is not None, f"cached {block} has no tag"


def _ids(block_ids: list[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long)
