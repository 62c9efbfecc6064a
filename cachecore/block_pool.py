"""Block pool: tensor-free bookkeeping of the KV pages (ids, ref counts, hashes, token ids, owners).

Every block is in exactly one of three states:

- **in use** (``ref_cnt > 0``): held by running requests; never evicted, never handed out again.
- **cached free** (``ref_cnt == 0``, hashed): still in the hash index and evictable (the eviction
  policy's), so a later request can hit it; evicted (hash dropped) only when it is reused or its
  owner's cap needs room.
- **plain free** (``ref_cnt == 0``, no hash): in the free queue, reused first.

The free queue holds the plain free blocks only: a cached block changes hands between requests (held,
freed, hit again) with no queue move, only its ref count and the policy's bookkeeping. Cached free
blocks are ordered by ``freed_at`` (least recently freed first), which ``free`` stamps on a request's
blocks deepest-first, so a shared short prefix is evicted after the longer tails that hang off it.
``iter_free`` lists plain then cached free blocks in that order. Cached capacity therefore grows and
shrinks with load.

**Which cached block goes: the eviction policy** (``policy``, an
:class:`~cachecore.eviction.base.EvictionPolicy`; by name from :mod:`cachecore.eviction.registry`,
``fair_lru`` by default). The pool keeps ref counts, the index, the free queue, per-owner usage,
weights and caps; it tells the policy which cached blocks become evictable (``free``), are taken
again (``touch``/``hit``) or leave (evicted, capped, flushed), and asks it for an allocation's victims
(given usage, weights and the pool size) and for a capped owner's order.

**Fair sharing, on by default** (every policy keeps it; ``fair_lru`` in
:mod:`cachecore.eviction.fair_lru`). An owner's *usage* is the blocks it holds or keeps cached. Each
owner with usage (and the one allocating) is *protected* up to ``num_blocks * weight // total_weight``
of the pool (equal shares unless ``set_weight``). When ``allocate`` must evict, it takes a cached block
among owners **over** their protected share (``fair_lru``: the least recently freed); only when none is
over does it evict the allocating owner's own blocks. Only when neither exists (the allocating owner
holds its share and more in running requests) does it fall back to any owner's block
(``stats.protected_evictions``): a running request is never refused for the sake of idle cache. The
engine's per-tenant in-flight limit keeps that fallback out of an attacker's reach. So a tenant that
floods evicts its own blocks or the unprotected surplus of others, never another tenant's protected
prefixes. With ``fair_lru``, deepest-first order holds inside an owner.

Per-owner caps (``set_cap``) are hard limits on top: an owner over its cap evicts its own least
recently freed blocks (the policy's order).

**Soft pins** (``pin``/``unpin``, named caches). A pin is kept by hash (``hash -> until``, unix time
of ``clock``), so a block registered later under a pinned hash (re-stored, promoted) is pinned too,
and it lapses by itself once ``until`` passes (the block is then an ordinary block again). The pins
live in the policy (``policy.pins``). A pin only reorders an owner's own evictions: its unpinned
cached-free blocks go first (in the policy's order), then its pinned ones. Which owner gives up a
block is decided exactly as without pins, so a pin never protects an owner over its share from
another owner's allocation once it has no unpinned blocks left, and pins never take another owner
below its share. With no pins the eviction paths are the plain ones; with pins an eviction also skips
past the owner's pinned blocks.

**One walk per request** (``hit_prefix``). A request's hit is found in one call: its first block by
key (stored token ids compared), each following one through the chain links between indexed blocks
(``cache_blocks`` adds them, the walk heals missing ones), so a hit block's key is read, not hashed;
only the rest of the chain is hashed and looked up. The walk and the links are the index's
(:mod:`cachecore.block_index`); namespaces, salts and exact-prefix matching are the keys' as before.

**Listeners.** Every hash the pool drops is announced first to each callable in ``listeners`` as
``listener(block, reason)`` (``"evicted"``, ``"capped"`` or ``"flushed"``) while the block still holds
its hash, tokens, tag and bytes; ``batch_listeners`` hear once per operation, or once per ``with
pool.batch():`` block (:mod:`cachecore.drop_listeners`). A listener must not call back into the pool.

**Layout.** This class is the facade and owns ref counts, the free queue of plain blocks (:mod:`cachecore.free_queue`)
and the count of cached free blocks; it drives, each behind its own small interface, the index
(``index``: :class:`~cachecore.block_index.BlockIndex`, key -> block and chain links), the owner
ledger (``ledger``: :class:`~cachecore.owner_ledger.OwnerLedger`, usage, cached counts, weights,
caps), the drop listeners and the eviction ``policy``; ``check_integrity`` is
:func:`cachecore.pool_integrity.check_integrity`. Read the pieces freely; change them through the
pool. The hot paths (``hit_prefix``, ``allocate``, ``free``, ``cache_blocks``) bind the pieces'
dicts to locals and keep their per-block loops inline.

All methods are O(1) per block touched (``value_aware``: O(log n)) except ``allocate``'s eviction,
O(owners) per evicted block (``drop_where`` and ``check_integrity`` are O(index)/O(pool)). Not
thread-safe: the caller holds its lock around every call.
"""


from __future__ import annotations

import itertools
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from cachecore.block_index import BlockIndex, KeyChain
from cachecore.drop_listeners import DropListeners
from cachecore.errors import OutOfBlocks
from cachecore.eviction.base import EvictionPolicy
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY, make_policy
from cachecore.free_queue import Block, FreeBlockQueue
from cachecore.owner_ledger import OwnerLedger
from cachecore.pool_integrity import check_integrity

__all__ = ["Block", "BlockPool", "FreeBlockQueue", "KeyChain", "PoolStats"]

_owner = operator.attrgetter("owner")
_freed_at = operator.attrgetter("freed_at")


@dataclass
class PoolStats:
    """Monotonic counters. ``evictions`` counts every hash dropped to make room (reuse or cap);
    ``cap_evictions`` is the cap-driven part; ``dropped`` counts flushes (``drop_where``)."""

    evictions: int = 0
    cap_evictions: int = 0
    duplicate_stores: int = 0
    collisions: int = 0
    cap_rejections: int = 0
    dropped: int = 0
    protected_evictions: int = 0  # last-resort evictions below an owner's share (see the module docstring)
    evictions_by_owner: Counter[str | None] = field(default_factory=Counter)


class BlockPool:
    """All ``num_blocks`` blocks are created up front; ``blocks[i].block_id == i``. ``policy``: the
    eviction policy (a registered name or an instance of its own; ``fair_lru`` by default).

    ``free_queue``, ``index`` and ``ledger`` are the pieces it drives (module docstring, Layout): read
    them, change them only through the pool."""

    def __init__(self, num_blocks: int, block_size: int,
                 policy: EvictionPolicy | str = DEFAULT_EVICTION_POLICY) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.stats = PoolStats()
        self.free_queue = FreeBlockQueue(self.blocks)
        self.index = BlockIndex(block_size)
        # The index's dict itself (key -> block): the pool's and the tiers' hot paths read it inline.
        self._index: dict[bytes, Block] = self.index.by_hash
        self.ledger = OwnerLedger()
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self._num_cached_free = 0
        self._clock = 0  # stamps Block.freed_at
        self._drops = DropListeners()
        self.clock: Callable[[], float] = time.time  # the time of soft pins (``policy.pins``)

    # ------------------------------------------------------------------ accounting (read-only)
    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: plain free plus cached free (evictable)."""
        return self.free_queue.num_free + self._num_cached_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still in the index (evictable cache)."""
        return self._num_cached_free

    @property
    def num_in_use(self) -> int:
        """Blocks with ``ref_cnt > 0`` (protected)."""
        return self.num_blocks - self.free_queue.num_free - self._num_cached_free

    @property
    def num_cached(self) -> int:
        """Blocks in the index, held or free."""
        return len(self._index)

    def cached_tokens(self, owner: str | None) -> int:
        """Tokens ``owner`` keeps in the index (held and free blocks); what its cap limits."""
        return self.ledger.cached[owner] * self.block_size

    def cap(self, owner: str) -> int | None:
        return self.ledger.caps.get(owner)

    def usage(self, owner: str) -> int:
        """Blocks ``owner`` holds or keeps cached: what its fair share protects."""
        return self.ledger.usage[owner]

    def protected(self, owner: str) -> int:
        """Blocks of ``owner`` that another owner's allocation may not evict now: its share of the pool
        among the owners with usage (``owner`` counted even when it has none yet)."""
        return self.ledger.protected(owner, self.num_blocks)

    def owners(self) -> list[str]:
        """Owners that hold or keep cached at least one block."""
        return self.ledger.owners()

    def set_weight(self, owner: str, weight: int) -> None:
        """Weight of ``owner``'s fair share (default 1). Takes effect at the next allocation."""
        self.ledger.set_weight(owner, weight)

    def iter_free(self) -> Iterator[Block]:
        """Free blocks: plain ones in queue order (reused first), then cached ones least recently freed
        first (with ``fair_lru``, an owner's eviction order). O(num_blocks log num_blocks); for tests
        and debugging. Do not mutate the pool while iterating."""
        cached = sorted((b for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None), key=_freed_at)
        return itertools.chain(self.free_queue, cached)

    # ------------------------------------------------------------------ listeners
    @property
    def listeners(self) -> list[Callable[[Block, str], None]]:
        """Called ``listener(block, reason)`` before each hash the pool drops (module docstring)."""
        return self._drops.listeners

    @property
    def batch_listeners(self) -> list[Callable[[], None]]:
        """Called once per operation that dropped hashes, or per ``batch()`` block."""
        return self._drops.batch_listeners

    @property
    def in_batch(self) -> bool:
        """Inside a ``batch()`` block: ``batch_listeners`` wait for its end."""
        return self._drops.in_batch

    def batch(self) -> AbstractContextManager[None]:
        """``with pool.batch():`` makes one operation of several for ``batch_listeners`` (nestable)."""
        return self._drops

    # ------------------------------------------------------------------ soft pins
    def pin(self, hashes: Iterable[bytes], until: float) -> None:
        """Pin ``hashes`` until ``until`` (``clock`` time; replaces an earlier pin's until). Blocks
        indexed under them now or later are evicted after their owner's unpinned ones (module doc)."""
        self.policy.pins.pin(hashes, until, self.clock())

    def unpin(self, hashes: Iterable[bytes]) -> int:
        """Remove the pins of ``hashes``; returns how many were pinned."""
        return self.policy.pins.unpin(hashes)

    def is_pinned(self, block_hash: bytes) -> bool:
        return self.policy.pins.is_pinned(block_hash, self.clock())

    @property
    def _pins(self) -> dict[bytes, float]:
        """The pins (hash -> until), lapsed ones included until purged: ``policy.pins.until``."""
        return self.policy.pins.until

    def pinned_tokens(self, owner: str | None) -> int:
        """Tokens of ``owner``'s indexed blocks (held or free) whose pin has not lapsed. O(pins)."""
        pins, index = self.policy.pins, self._index
        pins.expire(self.clock())
        n = 0
        for h in pins.until:
            block = index.get(h)
            n += block is not None and block.owner == owner
        return n * self.block_size

    # ------------------------------------------------------------------ lookup
    def get_cached(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The indexed block for ``block_hash`` if its stored token ids equal ``token_ids``, else None.

        A hash hit whose tokens differ is a miss and counts ``stats.collisions``. Does not take a
        reference: call ``touch`` to hold the block. Pass a tuple for speed.
        """
        block = self._index.get(block_hash)
        if block is None:
            return None
        if type(token_ids) is not tuple:
            token_ids = tuple(token_ids)  # a list never equals a tuple; an ndarray compares elementwise
        if block.token_ids == token_ids:
            return block
        self.stats.collisions += 1
        return None

    def hit_prefix(self, tokens: Sequence[int], blocks: Sequence[bytes], keys: KeyChain, take: int
                   ) -> tuple[list[Block], int, list[bytes]]:
        """One walk for a request: the longest prefix of its full blocks that the index holds with the
        request's token ids, and the keys of all its full blocks. ``blocks[i]`` is block ``i``'s token
        bytes (``hashing.token_blocks`` of ``tokens``); ``keys(blocks[a:], parent_key)`` returns their
        chain keys (``parent_key`` None: from the request's first block).

        The first block is looked up by its key and its stored token ids compared; each following one
        is its predecessor's child under the block's token bytes (a dict compare of the exact bytes:
        the stored token ids again), so a hit's key is read from the block, not hashed; past the
        linked part the rest of the chain is hashed (``keys``) and looked up key by key (token ids
        compared; a hash hit whose tokens differ ends the prefix and counts ``stats.collisions``),
        linking what it finds (``BlockIndex.walk``). Takes a reference on the first ``take`` blocks, as
        ``hit`` does. Returns (the blocks held, the length of the prefix found, the keys of every
        block)."""
        found, hashes, collisions = self.index.walk(tokens, blocks, keys)
        if collisions:
            self.stats.collisions += collisions
        held = found[:take] if take < len(found) else found
        if held:
            self._hold(held, 1)
        return held, len(found), hashes

    # ------------------------------------------------------------------ reference counting
    def touch(self, blocks: Sequence[Block]) -> None:
        """Take one reference on each block. A cached free block stops being evictable and keeps its hash.
        Raises ``ValueError`` (changing nothing) for a plain free block: allocate those. (A cache hit
        also counts ``block.hits``: see ``hit``.)"""
        self._take(blocks, 0)

    def hit(self, blocks: Sequence[Block]) -> None:
        """``touch`` for a request reusing these blocks from the index: also counts their reuse."""
        self._take(blocks, 1)

    def _take(self, blocks: Sequence[Block], hits: int) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(f"touch of plain free {block}: only held or cached blocks can be touched")
        self._hold(blocks, hits)

    def _hold(self, blocks: Sequence[Block], hits: int) -> None:
        """One reference more on each held or cached block (``hits`` added to its reuse count). A cached
        free block (not in the free queue) only leaves the policy's evictable blocks."""
        taken = []
        keep = taken.append
        for block in blocks:
            if not block.ref_cnt:
                keep(block)
            block.ref_cnt += 1
            block.hits += hits
        if taken:
            self.policy.take(taken)
            self._num_cached_free -= len(taken)

    def allocate(self, n: int, owner: str) -> list[Block]:
        """Take ``n`` blocks, each with ``ref_cnt == 1`` and ``owner``: plain free blocks first, then
        cached ones chosen by the eviction policy (module docstring), each evicted (its hash leaves
        the index) as it is taken. Raises ``OutOfBlocks`` without side effects when fewer than ``n``
        blocks are free (every other block is held by a running request). The message names no
        pool-wide figure (a tenant learns nothing about other tenants' use)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        victims = self._plan_evictions(n, owner)
        if victims is None:
            raise OutOfBlocks("not enough cache capacity for this request right now; retry shortly")
        out = self.free_queue.popleft_many(n - len(victims))  # plain free blocks: the head of the queue
        if victims:
            self._evict(victims)
            out += victims
            self._drops.done()
        for block in out:
            block.ref_cnt = 1
        self.ledger.set_owners(out, owner)
        return out

    def _plan_evictions(self, n: int, owner: str) -> list[Block] | None:
        """The cached free blocks ``allocate(n, owner)`` would evict, in order (the policy's answer),
        or None if it cannot."""
        plain = self.free_queue.num_free
        need = n - min(n, plain)
        if need == 0:
            return []
        if need > self._num_cached_free:
            return None
        ledger = self.ledger
        usage = Counter(ledger.usage)
        usage[owner] += n - need
        victims, protected = self.policy.victims(need, owner, usage, ledger.weights, self.num_blocks, self.clock)
        self.stats.protected_evictions += protected
        return victims

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference per entry. ``blocks`` is a block table, prefix first: blocks reaching 0
        become free deepest first (evicted first): hashed ones evictable, most recently freed, keeping
        hash and data; plain ones at the head of the free queue. Owners over their cap then evict their
        own oldest free blocks. Raises ``ValueError`` (changing nothing) if a block would drop below zero."""
        hashed: list[Block] = []
        plain: list[Block] = []
        keep = hashed.append
        clock = self._clock
        for i in range(len(blocks) - 1, -1, -1):  # deepest first
            block = blocks[i]
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if ref > 0:
                continue
            if ref < 0:
                for undo in blocks[i:]:  # every reference dropped so far, this one included
                    undo.ref_cnt += 1
                raise ValueError(f"free of {block}: more frees than references")
            if block.block_hash is None:
                plain.append(block)
            else:
                clock += 1
                block.freed_at = clock
                keep(block)
        self._clock = clock
        queue = self.free_queue
        if plain:
            set_owner = self.ledger.set_owner
            for block in plain:
                set_owner(block, None)
                queue.appendleft(block)
        if not hashed:
            return
        self._num_cached_free += len(hashed)
        self.policy.add(hashed)
        caps = self.ledger.caps
        if caps:
            for owner in {b.owner for b in hashed}.intersection(caps):
                self._trim(owner, caps[owner])

    # ------------------------------------------------------------------ the index
    def cache(
        self, block: Block, block_hash: bytes, token_ids: Sequence[int], owner: str, tag: object | None = None,
    ) -> Block:
        """Register a held, full block under ``block_hash``; returns the block that now serves that key.

        - Key already indexed with the same tokens: a duplicate store (``stats.duplicate_stores``);
          returns the existing block, ``block`` stays un-hashed (its holder may keep using it).
        - Key indexed with other tokens: a collision (``stats.collisions``); returns ``block`` un-hashed.
        - Caching would put ``owner`` over its cap: first evicts ``owner``'s own least recently freed
          blocks; if its cached blocks are all held, nothing is cached (``stats.cap_rejections``) and
          ``block`` is returned un-hashed.
        - Re-caching a block under its own key is a no-op.

        So ``result is block and block.block_hash is not None`` means "newly cached". Raises
        ``ValueError`` for a block that is not held, already cached under another key, or
        ``token_ids`` not exactly ``block_size`` long.
        """
        tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
        if block.ref_cnt <= 0:
            raise ValueError(f"cache of {block}: only held blocks can be cached")
        if len(tokens) != self.block_size:
            raise ValueError(f"cache needs {self.block_size} token ids, got {len(tokens)}")
        if block.block_hash is not None:
            if block.block_hash == block_hash and block.token_ids == tokens:
                return block
            raise ValueError(f"{block} is already cached under another key")
        existing = self._index.get(block_hash)
        if existing is not None:
            if existing.token_ids == tokens:
                self.stats.duplicate_stores += 1
                return existing
            self.stats.collisions += 1
            return block
        ledger = self.ledger
        cap = ledger.caps.get(owner)
        if cap is not None and (ledger.cached[owner] + 1) * self.block_size > cap:
            held = ledger.cached[owner] - self.policy.evictable(owner)
            if (held + 1) * self.block_size > cap:
                self.stats.cap_rejections += 1
                return block
            self._trim(owner, cap - self.block_size)
        self.index.add(block, block_hash, tokens, tag)
        ledger.set_owner(block, owner)
        ledger.cached[owner] += 1
        return block

    def cache_blocks(self, blocks: Sequence[Block], keys: Sequence[bytes], tokens: Sequence[int], owner: str,
                     tag: object | None = None, *, parent: bytes | None = None,
                     links: Sequence[bytes] | None = None) -> list[Block]:
        """``cache`` for a run of held blocks (block ``i`` under ``keys[i]``, holding ``tokens[i *
        block_size : (i + 1) * block_size]``), in order; returns the blocks newly cached. A block whose
        key is taken, that is cached already or not held, or whose owner has a cap, goes through
        ``cache`` with every rule there; the others are indexed in one loop. ``ValueError`` when
        ``blocks``, ``keys`` and the token blocks differ in number.

        ``links`` (the blocks' token bytes, ``hashing.token_blocks``) also links each block that now
        serves its key under the one serving the key before it (``parent``: the key before
        ``keys[0]``), for ``hit_prefix``. Only for keys that continue that chain without extras
        (``keys[i] = K(ns; keys[i - 1], tokens_i)``), as the engine's own requests' are."""
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(f"cache_blocks needs {len(blocks) * bs} token ids, got {len(tokens)}")
        index = self._index
        ledger = self.ledger
        capped = owner in ledger.caps
        new: list[Block] = []
        keep = new.append
        indexed = 0
        up = index.get(parent) if parent is not None and links is not None else None
        groups = zip(*[iter(tokens)] * bs, strict=False)  # each block's token ids as a tuple, built in C
        for i, (block, key, toks) in enumerate(zip(blocks, keys, groups, strict=True)):
            if capped or block.ref_cnt <= 0 or block.block_hash is not None or key in index:
                if self.cache(block, key, toks, owner, tag) is block and block.block_hash is not None:
                    keep(block)
                if links is not None:
                    served = index.get(key)
                    if up is not None and served is not None and served.parent is None and served is not up:
                        BlockIndex.link(up, served, links[i])
                    up = served
                continue
            index[key] = block  # BlockIndex.add, inlined
            block.block_hash = key
            block.token_ids = toks
            block.tag = tag
            block.hits = 0
            if block.owner != owner:
                ledger.set_owner(block, owner)
            keep(block)
            indexed += 1
            if links is not None:
                if up is not None:  # BlockIndex.link, inlined
                    link = links[i]
                    kids = up.children
                    if kids is None:
                        up.children = kids = {}
                    kids[link] = block
                    block.parent = up
                    block.link = link
                up = block
        if indexed:
            ledger.cached[owner] += indexed
        return new

    def set_cap(self, owner: str, max_tokens: int | None) -> None:
        """Limit the tokens ``owner`` keeps in the index (``None``: no cap). Lowering it evicts the
        owner's free blocks at once, oldest first; held blocks stay until freed."""
        self.ledger.set_cap(owner, max_tokens)
        if max_tokens is not None:
            self._trim(owner, max_tokens)

    def drop_where(self, predicate: Callable[[Block], bool], *, reason: str = "flushed") -> int:
        """Flush: remove every indexed block matching ``predicate`` from the index; returns how many.

        Held blocks stay held and usable by their request but can never be hit again; free ones
        become plain free blocks (reused first). ``predicate`` sees indexed blocks only and must not
        call back into the pool.
        """
        return self._drop([b for b in self._index.values() if predicate(b)], reason)

    def drop_hashes(self, hashes: Iterable[bytes], *, reason: str = "flushed") -> int:
        """``drop_where`` for the blocks indexed under ``hashes`` (O(len(hashes))); their pins stay
        (``unpin`` them too)."""
        index = self._index
        return self._drop([index[h] for h in dict.fromkeys(hashes) if h in index], reason)

    def drop_owner(self, owner: str) -> int:
        """``drop_where`` for every block cached by ``owner``."""
        return self.drop_where(lambda b: b.owner == owner)

    # ------------------------------------------------------------------ internals
    def _drop(self, matches: list[Block], reason: str) -> int:
        drops, queue, set_owner = self._drops, self.free_queue, self.ledger.set_owner
        for block in matches:
            was_free = block.ref_cnt == 0
            drops.announce(block, reason)
            self._unindex(block, was_free=was_free)
            if was_free:
                set_owner(block, None)
                queue.appendleft(block)
        self.stats.dropped += len(matches)
        if matches:
            drops.done()
        return len(matches)

    def _evict(self, blocks: list[Block]) -> None:
        """Evict cached free ``blocks`` taken to be reused: each is announced
        (``"evicted"``) while it still holds its hash, then they leave the index and the policy."""
        self._drops.announce_many(blocks, "evicted")
        self.policy.remove_many(blocks, evicted=True)
        self.index.remove_many(blocks)
        per_owner = Counter(map(_owner, blocks))
        self.ledger.uncache_counts(per_owner)
        self._num_cached_free -= len(blocks)
        self.stats.evictions += len(blocks)
        self.stats.evictions_by_owner.update(per_owner)

    def _unindex(self, block: Block, *, was_free: bool, evicted: bool = False) -> None:
        """Take ``block`` out of the index, its owner's cached count and (``was_free``) the policy."""
        assert block.block_hash is not None
        self.ledger.uncache(block.owner)
        if was_free:
            self.policy.remove(block, evicted=evicted)  # while the block still holds its hash
            self._num_cached_free -= 1
        self.index.remove(block)

    def _trim(self, owner: str, max_tokens: int) -> None:
        """Evict ``owner``'s free blocks (the policy's order: ``fair_lru``, least recently freed first;
        pinned last) until it fits ``max_tokens`` or has none free."""
        policy = self.policy
        if not policy.evictable(owner):
            return
        excess = self.ledger.cached[owner] - max_tokens // self.block_size
        if excess <= 0:
            return
        stats, drops, queue, set_owner = self.stats, self._drops, self.free_queue, self.ledger.set_owner
        for block in list(itertools.islice(policy.order(owner, self.clock), excess)):
            stats.evictions += 1
            stats.evictions_by_owner[block.owner] += 1
            stats.cap_evictions += 1
            drops.announce(block, "capped")
            self._unindex(block, was_free=True, evicted=True)
            set_owner(block, None)
            queue.appendleft(block)
        drops.done()

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Assert every invariant of the pool; raises ``AssertionError`` naming the first broken one
        (:func:`cachecore.pool_integrity.check_integrity`).

        O(num_blocks + index); meant for tests and idle-time checks.
        """
        check_integrity(self)
