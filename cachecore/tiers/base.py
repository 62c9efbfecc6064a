"""The contracts of the cache tiers.

Two levels, as in docs/design.md section 2:

- :class:`PrefixCache` is the public, namespace-keyed contract (``lookup / store / retrieve``) that the
  orchestrator (``cachecore.engine.CacheEngine``) offers, the same at every tier.
- :class:`BlockStore` is the hash-keyed contract of one store (L1 device pages, L2 host memory, and
  later L3): it keeps bytes of whole blocks under the orchestrator's chain hashes and knows nothing
  about requests, namespaces or policies.

Metadata hit and bytes delivered are different things: ``lookup``/``contains`` answer from the index
only, ``retrieve``/``get`` say which blocks really arrived. A failed, late or corrupt load is a miss
for that block and every block after it, never wrong bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from cachecore.namespace import Namespace


class Tag(NamedTuple):
    """What a cached block belongs to; flushes select blocks by it. ``persist``: the request allowed
    the block beyond host memory (``prompt_cache_retention``), read by the tiers below L2. ``gen``:
    the flush generation (``FlushFence``) its request was admitted at, so a probe after a flush at
    generation G counts only what was cached before it (``gen < G``), not later traffic."""

    owner: str
    model: str
    revision: str
    ns_digest: bytes
    persist: bool = True
    gen: int = 0


class Retrieved(NamedTuple):
    """``kv``: ``[n_blocks, *page_shape]`` for the contiguous prefix that arrived; ``mask``: one bool per
    token of the query, True for the tokens whose KV is in ``kv`` (always a prefix of the query)."""

    kv: torch.Tensor
    mask: torch.Tensor


class Fetched(NamedTuple):
    """What a store's ``get`` delivered: ``kv`` ``[n, *page_shape]`` for the first ``n`` requested
    blocks (contiguous), and why it stopped early (``"miss"``, ``"corrupt"``) or ``None``."""

    kv: torch.Tensor
    stopped: str | None


class PrefixCache(ABC):
    """The orchestrator's public contract. Only full blocks are ever stored or returned."""

    name: str

    @abstractmethod
    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        """Length in tokens of the contiguous cached prefix of ``tokens`` (a multiple of the block size).
        Never mutates eviction order or contents."""

    @abstractmethod
    def store(
        self, ns: Namespace, tokens: Sequence[int], kv: torch.Tensor, *, owner: str, request_salt: bytes = b""
    ) -> int:
        """Store the KV of the full blocks of ``tokens`` (``kv``: ``[n_blocks, *page_shape]``). Blocks
        already present are recognised and not stored twice. Returns the number of blocks newly stored."""

    @abstractmethod
    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        """Copy out the KV of the longest cached prefix of ``tokens``; see :class:`Retrieved`."""


class BlockStore(ABC):
    """One store of whole blocks under chain-hash keys, each with its token ids (re-checked on every
    read: a key whose stored tokens differ is a miss) and its :class:`Tag`.

    Thread-safe: every method may be called from any thread. Every method is always safe to call:
    bad keys are misses, a full store refuses a ``put`` (returns False), nothing raises for lack of
    space. What a pool-backed store drops (eviction, flush, corruption) is announced by its
    ``pool.listeners`` (see :class:`~cachecore.block_pool.BlockPool`), which the orchestrator hears.
    """

    name: str

    @abstractmethod
    def contains(self, key: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether ``key`` is stored with exactly ``tokens``. Mutates nothing (not even LRU order)."""

    @abstractmethod
    def put(self, key: bytes, tokens: tuple[int, ...], tag: Tag, kv: torch.Tensor) -> bool:
        """Store one block (``kv``: ``[1, *page_shape]`` or ``page_shape``), evicting by the store's
        fair-share policy if needed. Returns True if newly stored; False for a duplicate or when no
        room can be made without evicting another owner's protected share."""

    @abstractmethod
    def get(self, items: Sequence[tuple[bytes, tuple[int, ...]]]) -> Fetched:
        """Copy out the blocks of ``items`` (key, tokens), in order, stopping at the first one that is
        missing or fails its integrity check (that one is dropped and announced as ``"corrupt"``).
        Counts as a use of each block delivered (LRU)."""

    @abstractmethod
    def delete(self, match: Callable[[Tag], bool]) -> int:
        """Drop every block whose tag matches (flush, retire, offboard); returns how many."""

    @abstractmethod
    def count(self, match: Callable[[Tag], bool]) -> int:
        """Blocks whose tag matches (the probe after a flush)."""

    @abstractmethod
    def gauges(self) -> dict[str, int]:
        """``total``, ``used`` (blocks), ``bytes_per_block`` and the store's counters."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the store's invariants (``AssertionError`` naming the first broken one)."""
