"""``check_integrity(pool)``: every invariant of a :class:`~cachecore.block_pool.BlockPool`, over its
public views (``blocks``, ``free_queue``, ``index``, ``ledger``, ``policy``, ``num_cached_free``).

Each piece checks its own structure (``FreeBlockQueue.check``, ``BlockIndex.check``,
``OwnerLedger.check``, the policy's ``check``); this module checks how they agree: ref count 0 iff
queued, plain free blocks ahead of cached ones, the policy's evictable blocks = the cached free ones,
caps met. O(num_blocks + index); for tests and idle-time checks (``BlockPool.check_integrity``).
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

    in_use = 0
    for block in blocks:
        in_queue = block.block_id in seen
        assert block.ref_cnt >= 0, f"negative ref_cnt on {block}"
        assert (block.ref_cnt == 0) == in_queue, f"{block}: ref_cnt==0 must mean in free queue"
        if not in_queue:
            assert block.prev_free is None and block.next_free is None, f"held {block} still linked"
            in_use += 1
    assert len(walked) + in_use == total, f"free {len(walked)} + in use {in_use} != total {total}"

    pool.index.check(blocks)
    ledger = pool.ledger
    ledger.check(blocks)

    # Queue shape: plain free blocks first, then cached ones; the policy's evictable blocks = these
    # (fair_lru: per owner, in queue order).
    policy = pool.policy
    cached_walk = [b for b in walked if b.block_hash is not None]
    first_cached = next((i for i, b in enumerate(walked) if b.block_hash is not None), len(walked))
    assert all(b.block_hash is not None for b in walked[first_cached:]), "plain free block behind a cached one"
    assert len(cached_walk) == pool.num_cached_free, "num_cached_free out of sync"
    per_owner: dict[str | None, list[int]] = {}
    for block in cached_walk:
        per_owner.setdefault(block.owner, []).append(block.block_id)
    for owner in set(per_owner) | set(policy.owners()):
        n = len(per_owner.get(owner, ()))
        assert policy.evictable(owner) == n, f"policy counts {policy.evictable(owner)} evictable " \
            f"blocks of {owner!r}, the free queue {n}"
    policy.check({o: [blocks[i] for i in ids] for o, ids in per_owner.items()})

    for owner, cap in ledger.caps.items():
        assert ledger.cached[owner] * bs <= cap or owner not in per_owner, f"{owner!r} over cap with evictable blocks"
    policy.pins.check(bytes)
