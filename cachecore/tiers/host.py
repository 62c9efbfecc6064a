"""L2: a preallocated host-memory pool of whole KV blocks (pinned when CUDA is present).

Bookkeeping is a :class:`~cachecore.block_pool.BlockPool` of its own (so L2 has the same keys, token
re-check, deepest-first order and fair-share eviction among tenants as L1); the bytes live in one
host tensor ``[num_blocks, *page_shape]`` allocated once. Every stored block carries a CRC-32 of its
bytes, checked on every read: a block that fails it is dropped (announced as ``"corrupt"``) and is a
miss for it and every block after it, never wrong bytes.

Blocks are held (ref count > 0) only for the instant a ``put`` writes or a ``get`` copies them, under
this store's lock, so a block is never overwritten while it is read.

What it drops is announced by ``pool.listeners``; what it newly stores, by ``stored_listeners``
(``listener(keys)``, once per ``put``/``put_many``, under this store's lock, inside the pool's batch of
that operation, so its evictions and its stores form one batch for ``pool.batch_listeners``).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence

import torch

from cachecore.block_pool import Block, BlockPool
from cachecore.errors import OutOfBlocks
from cachecore.eviction.base import EvictionPolicy
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY
from cachecore.layout import KVLayout
from cachecore.tiers.base import Fetched, Tag
from cachecore.tiers.pooled import PooledStore


class HostStore(PooledStore):
    name = "l2"

    def __init__(self, layout: KVLayout, num_blocks: int, *, pin_memory: bool | None = None,
                 eviction_policy: EvictionPolicy | str = DEFAULT_EVICTION_POLICY) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.pool = BlockPool(num_blocks, layout.block_size, eviction_policy)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.data = torch.empty((num_blocks, *layout.page_shape), dtype=layout.torch_dtype, pin_memory=pin)
        self.pinned = pin
        self._crc = [0] * num_blocks
        self._lock = threading.RLock()
        self.stats = {"puts": 0, "duplicates": 0, "rejected": 0, "corrupt": 0, "gets": 0, "blocks_out": 0}
        self.stored_listeners: list[Callable[[list[bytes]], None]] = []

    # ------------------------------------------------------------------ contract
    def put(self, key: bytes, tokens: tuple[int, ...], tag: Tag, kv: torch.Tensor) -> bool:
        src = kv.reshape(self.layout.page_shape)
        with self._lock, self.pool.batch():
            if self.pool.get_cached(key, tokens) is not None:
                self.stats["duplicates"] += 1
                return False
            try:
                (block,) = self.pool.allocate(1, tag.owner)
            except OutOfBlocks:
                self.stats["rejected"] += 1
                return False
            try:
                self.data[block.block_id].copy_(src)
                self._crc[block.block_id] = _crc(self.data[block.block_id])
                kept = self.pool.cache(block, key, tokens, tag.owner, tag)
                stored = kept is block and block.block_hash is not None
            finally:
                self.pool.free([block])
            self.stats["puts" if stored else "rejected"] += 1
            if stored:
                for listener in self.stored_listeners:
                    listener([key])
            return stored

    def put_many(self, entries: Sequence[tuple[bytes, tuple[int, ...], Tag]], kv: torch.Tensor) -> int:
        """``put`` of many blocks (``kv``: ``[n, *page_shape]``, row i for entry i) with one copy;
        returns how many were newly stored."""
        with self._lock, self.pool.batch():
            taken: list[tuple[Block, int, bytes, tuple, Tag]] = []
            try:
                for row, (key, tokens, tag) in enumerate(entries):
                    if self.pool.get_cached(key, tokens) is not None:
                        self.stats["duplicates"] += 1
                        continue
                    try:
                        (block,) = self.pool.allocate(1, tag.owner)
                    except OutOfBlocks:
                        self.stats["rejected"] += 1
                        continue
                    taken.append((block, row, key, tokens, tag))
                if not taken:
                    return 0
                ids = torch.tensor([t[0].block_id for t in taken], dtype=torch.long)
                rows = torch.tensor([t[1] for t in taken], dtype=torch.long)
                self.data.index_copy_(0, ids, kv.index_select(0, rows.to(kv.device)).to(self.data.device))
                stored = 0
                keys = []
                for block, _, key, tokens, tag in taken:
                    self._crc[block.block_id] = _crc(self.data[block.block_id])
                    kept = self.pool.cache(block, key, tokens, tag.owner, tag)
                    if kept is block and block.block_hash is not None:
                        stored += 1
                        keys.append(key)
            finally:
                if taken:
                    self.pool.free([t[0] for t in taken])
            if keys:
                for listener in self.stored_listeners:
                    listener(keys)
            self.stats["puts"] += stored
            self.stats["rejected"] += len(taken) - stored
            return stored

    def get(self, items: Sequence[tuple[bytes, tuple[int, ...]]]) -> Fetched:
        stopped = None
        with self._lock:
            self.stats["gets"] += 1
            blocks: list[Block] = []
            for key, tokens in items:
                block = self.pool.get_cached(key, tokens)
                if block is None:
                    stopped = "miss"
                    break
                blocks.append(block)
            self.pool.hit(blocks)
            try:
                ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
                kv = self.data.index_select(0, ids)
                good = len(blocks)
                for row, block in enumerate(blocks):
                    if _crc(kv[row]) != self._crc[block.block_id]:
                        good = row
                        break
            finally:
                self.pool.free(blocks)
            if good < len(blocks):
                bad = blocks[good]
                self.stats["corrupt"] += 1
                self.pool.drop_where(lambda b: b is bad, reason="corrupt")
                stopped = "corrupt"
                kv = kv[:good]
            self.stats["blocks_out"] += good
        return Fetched(kv, stopped)

    # ------------------------------------------------------------------ named caches (soft pins)
    def prefix(self, items: Sequence[tuple[bytes, tuple[int, ...]]]) -> int:
        """Leading entries of ``items`` (key, tokens) stored here (index only)."""
        with self._lock:
            index, n = self.pool._index, 0
            for key, tokens in items:
                block = index.get(key)
                if block is None or block.token_ids != tokens:
                    break
                n += 1
            return n

    def pin(self, keys: Sequence[bytes], until: float | None) -> None:
        """Soft-pin ``keys`` until ``until`` (``BlockPool.pin``; None: unpin)."""
        with self._lock:
            if until is None:
                self.pool.unpin(keys)
            else:
                self.pool.pin(keys, until)

    def drop_keys(self, keys: Sequence[bytes]) -> int:
        """Delete the blocks stored under ``keys`` and their pins (announced as ``"flushed"``); how many."""
        with self._lock:
            self.pool.unpin(keys)
            return self.pool.drop_hashes(keys)

    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {"total": self.pool.num_blocks, "used": self.pool.num_cached,
                    "bytes_per_block": self.layout.bytes_per_block, "evictions": self.pool.stats.evictions,
                    **self.stats}

    def check_integrity(self) -> None:
        with self._lock:
            self.pool.check_integrity()
            assert self.pool.num_in_use == 0, "an L2 block is held outside a put or get"

    # ------------------------------------------------------------------ test hook
    def corrupt(self, key: bytes) -> bool:
        """Test hook: flip bytes of the block stored under ``key`` (its checksum then fails)."""
        with self._lock:
            block = self.pool._index.get(key)
            if block is None:
                return False
            self.data[block.block_id].view(-1)[0] += 1.0
            return True


def _crc(page: torch.Tensor) -> int:
    return zlib.crc32(page.contiguous().view(torch.uint8).numpy())
