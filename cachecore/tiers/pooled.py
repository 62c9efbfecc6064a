"""What the two block-pool stores (L1 ``DeviceStore``, L2 ``HostStore``) share: their index is a
:class:`~cachecore.block_pool.BlockPool` whose cached blocks carry their ``Tag``."""

from __future__ import annotations

from collections.abc import Callable

from cachecore.tiers.base import BlockStore, Tag


class PooledStore(BlockStore):
    """Index-only parts of the contract over ``self.pool``, under ``self._lock``."""

    def contains(self, key: bytes, tokens: tuple[int, ...]) -> bool:
        with self._lock:
            block = self.pool._index.get(key)
            return block is not None and block.token_ids == tokens

    def delete(self, match: Callable[[Tag], bool]) -> int:
        with self._lock:
            return self.pool.drop_where(lambda b: b.tag is not None and match(b.tag))

    def count(self, match: Callable[[Tag], bool]) -> int:
        with self._lock:
            return sum(1 for b in self.pool._index.values() if b.tag is not None and match(b.tag))

    def resident(self) -> dict[str, int]:
        """Blocks held or kept cached per owner (tenant)."""
        with self._lock:
            return {o: self.pool.usage(o) for o in self.pool.owners()}
