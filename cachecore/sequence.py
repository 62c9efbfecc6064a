"""A running request's cache state (what ``CacheEngine.admit`` hands out and takes back)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from cachecore.block_pool import Block
from cachecore.namespace import Namespace
from cachecore.tiers.base import Tag


@dataclass(eq=False)
class CachedSequence:
    """``tokens`` grows as tokens are generated. ``num_cached_tokens`` is final only after
    ``CacheEngine.finish_loads`` (a lower-tier prefix may still be arriving)."""

    seq_id: int
    ns: Namespace
    tag: Tag
    request_salt: bytes
    tokens: list[int]
    prompt_len: int
    blocks: list[Block]
    hashes: list[bytes]
    num_cached_tokens: int  # prefix whose prefill is skipped
    lookup_hit_tokens: int  # what the indexes held (may exceed num_cached_tokens by the last-token rule)
    num_computed: int = 0  # tokens whose KV is written into the pages
    num_registered: int = 0  # leading blocks already in the L1 index (hit, promoted or committed)
    flush_gen: int = 0
    use_cache: bool = True
    count_query: bool = False  # this admission is the request's one count in the metrics (``engine.admit``)
    released: bool = False
    pending: Future | None = field(default=None, repr=False)  # the L2 load in flight (prefetch)
    load_blocks: list[Block] = field(default_factory=list, repr=False)  # fresh L1 blocks it fills
    load_started: float = 0.0
    l3_chunks: int = 0  # leading L3 chunks of this request already written (or submitted)
    retention_seconds: float | None = None
    # Where its cached prefix came from (tokens per tier), why a lower-tier load stopped short
    # ("late", "failed", "corrupt", "unavailable", "expired", "recompute"; None when it did not), and
    # the prompt tokens this sequence added to L1 (its own full prompt blocks newly registered).
    tier_tokens: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    load_stop: str | None = None
    written_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Each full block's token bytes (``hashing.token_blocks``): the pool's chain links (commit).
    token_blocks: list[bytes] = field(default_factory=list, repr=False)

    @property
    def block_table(self) -> list[int]:
        return [b.block_id for b in self.blocks]
