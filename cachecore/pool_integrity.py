"""``check_integrity(pool)``: every invariant of a :class:`~cachecore.block_pool.BlockPool`, over its
public views (``blocks``, ``free_queue``, ``index``, ``ledger``, ``policy``, ``num_cached_free``).

Each piece checks its own structure (``FreeBlockQueue.check``, ``BlockIndex.check``,
``OwnerLedger.check``, the policy's ``check``); this module checks how they agree: plain free (ref
count 0, no hash) iff queued, the policy's evictable blocks = the cached free ones (ref count 0,
hashed), caps met. O(num_blocks + index); for tests and idle-time checks (``BlockPool.check_integrity``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachecore.block_pool import BlockPool

__all__ = ["check_integrity"]


def check_integrity(pool: BlockPool) -> None:
    """Assert every invariant of ``pool``; raises ``AssertionError`` naming the first broken one."""
    blocks, total, bs = pool.blocks, pool.num_blocks, pool.block_size
    walked = pool.free_queue.check(blocks)
    seen = {b.block_id for b in walked}

    cached_free: list = []
    for block in blocks:
        assert block.ref_cnt >= 0, f"negative ref_cnt on {block}"
        plain_free = block.ref_cnt == 0 and block.block_hash is None
        assert plain_free == (block.block_id in seen), f"{block}: plain free must mean in the free queue"
        if not plain_free:
            assert block.prev_free is None and block.next_free is None, f"{block} not plain free but queued"
        if block.ref_cnt == 0 and block.block_hash is not None:
            cached_free.append(block)
    assert len(cached_free) == pool.num_cached_free, "num_cached_free out of sync"
    assert pool.num_free + pool.num_in_use == total, "free + in use != total"

    pool.index.check(blocks)
    ledger = pool.ledger
    ledger.check(blocks)

    # The policy's evictable blocks = the cached free ones (fair_lru: per owner, least recently freed
    # first; free stamps every freed block with a new freed_at).
    policy = pool.policy
    cached_free.sort(key=lambda b: b.freed_at)
    per_owner: dict[str | None, list[int]] = {}
    for block in cached_free:
        per_owner.setdefault(block.owner, []).append(block.block_id)
    for owner in set(per_owner) | set(policy.owners()):
        n = len(per_owner.get(owner, ()))
        assert policy.evictable(owner) == n, f"policy counts {policy.evictable(owner)} evictable " \
            f"blocks of {owner!r}, the pool {n}"
    policy.check({o: [blocks[i] for i in ids] for o, ids in per_owner.items()})

    for owner, cap in ledger.caps.items():
        assert ledger.cached[owner] * bs <= cap or owner not in per_owner, f"{owner!r} over cap with evictable blocks"
    policy.pins.check(bytes)
