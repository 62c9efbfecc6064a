"""Owner ledger: who holds what in a block pool, per owner (tenant).

- ``usage``: blocks the owner holds (ref count > 0) or keeps cached; what its fair share protects
  (``protected``; the eviction policy reads it with ``weights``).
- ``cached``: blocks the owner keeps in the index, held or free; what its cap limits.
- ``weights``: its fair-share weight (absent: 1). ``caps``: its cap in tokens (absent: none).

Counts only; which blocks are whose is ``Block.owner``, which the ledger sets (``set_owner``) so the
two never disagree. Enforcing a cap (evicting the owner's free blocks) is the pool's
(:mod:`cachecore.block_pool`); the ledger keeps the number.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from cachecore.eviction.base import share, total_weight
from cachecore.free_queue import Block

__all__ = ["OwnerLedger"]


class OwnerLedger:
    """Per-owner usage, cached counts, weights and caps (module docstring). Counters drop an owner's
    entry when it reaches 0."""

    __slots__ = ("usage", "cached", "weights", "caps")

    def __init__(self) -> None:
        self.usage: Counter[str] = Counter()
        self.cached: Counter[str | None] = Counter()
        self.weights: dict[str, int] = {}
        self.caps: dict[str, int] = {}

    # ------------------------------------------------------------------ who holds a block
    def set_owner(self, block: Block, owner: str | None) -> None:
        """Make ``owner`` (``None``: nobody, a plain free block) the owner of ``block``, moving its usage."""
        old = block.owner
        if old == owner:
            return
        usage = self.usage
        if old is not None:
            usage[old] -= 1
            if not usage[old]:
                del usage[old]
        if owner is not None:
            usage[owner] += 1
        block.owner = owner

    def set_owners(self, blocks: Sequence[Block], owner: str) -> None:
        """``set_owner`` for a whole allocation."""
        usage = self.usage
        moved = 0
        for block in blocks:
            old = block.owner
            if old != owner:
                if old is not None:
                    usage[old] -= 1
                    if not usage[old]:
                        del usage[old]
                block.owner = owner
                moved += 1
        if moved:
            usage[owner] += moved

    # ------------------------------------------------------------------ cached counts
    def uncache(self, owner: str | None) -> None:
        """One block of ``owner`` left the index."""
        cached = self.cached
        cached[owner] -= 1
        if not cached[owner]:
            del cached[owner]

    def uncache_counts(self, per_owner: Counter[str | None]) -> None:
        """``per_owner[o]`` blocks of each owner ``o`` left the index."""
        cached = self.cached
        for owner, n in per_owner.items():
            left = cached[owner] - n
            if left:
                cached[owner] = left
            else:
                del cached[owner]

    # ------------------------------------------------------------------ shares, weights, caps
    def owners(self) -> list[str]:
        """Owners that hold or keep cached at least one block."""
        return [o for o, n in self.usage.items() if n > 0]

    def protected(self, owner: str, num_blocks: int) -> int:
        """``owner``'s share of ``num_blocks`` among the owners with usage (``owner`` counted even when
        it has none yet)."""
        return share(num_blocks, owner, self.weights, total_weight(self.usage, self.weights, owner))

    def set_weight(self, owner: str, weight: int) -> None:
        """Weight of ``owner``'s fair share (default 1)."""
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ValueError(f"weight must be an int >= 1, got {weight!r}")
        if weight == 1:
            self.weights.pop(owner, None)
        else:
            self.weights[owner] = weight

    def set_cap(self, owner: str, max_tokens: int | None) -> None:
        """Record ``owner``'s cap in tokens (``None``: no cap); ``ValueError`` (changing nothing) for
        anything but an int >= 0 or None."""
        if max_tokens is None:
            self.caps.pop(owner, None)
            return
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        self.caps[owner] = max_tokens

    # ------------------------------------------------------------------ invariants
    def check(self, blocks: Sequence[Block]) -> None:
        """Assert the counts against a recount over every block of the pool; ``AssertionError`` naming
        the first broken one."""
        cached: Counter[str | None] = Counter(b.owner for b in blocks if b.block_hash is not None)
        assert cached == self.cached, f"per-owner cached counts {dict(self.cached)} != {dict(cached)}"
        usage: Counter[str] = Counter(
            b.owner for b in blocks if b.owner is not None and (b.ref_cnt > 0 or b.block_hash is not None)
        )
        assert usage == self.usage, f"per-owner usage {dict(self.usage)} != {dict(usage)}"
        for block in blocks:
            assert block.owner is not None or (block.ref_cnt == 0 and block.block_hash is None), \
                f"{block}: held or cached without an owner"
