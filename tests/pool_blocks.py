"""Blocks for pool-level tests: block x's tokens and key, and one request of an owner caching a chain
of them (shared by the pin and eviction-policy tests)."""

from __future__ import annotations

import hashlib

from cachecore.block_pool import BlockPool

BS = 4  # tokens per block in these tests


def toks(x: int) -> tuple[int, ...]:
    return tuple(x * 10 + i for i in range(BS))


def key(x: int) -> bytes:
    return hashlib.blake2b(str(x).encode(), digest_size=32).digest()


def cache_free(pool: BlockPool, xs: list[int], owner: str) -> None:
    """One request of ``owner`` caching one block per x (a chain, prefix first), then releasing it."""
    blocks = pool.allocate(len(xs), owner)
    for block, x in zip(blocks, xs, strict=True):
        pool.cache(block, key(x), toks(x), owner)
    pool.free(blocks)
    pool.check_integrity()


def has(pool: BlockPool, x: int) -> bool:
    return pool.get_cached(key(x), toks(x)) is not None


class Clock:
    """A clock the test moves by hand (``clock.t += 5``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
