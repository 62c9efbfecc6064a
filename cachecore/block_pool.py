"""Block pool: tensor-free bookkeeping of the KV pages (ids, ref counts, hashes, token ids, owners).

Every block is in exactly one of three states:

- **in use** (``ref_cnt > 0``): held by running requests; never evicted, never handed out again.
- **cached free** (``ref_cnt == 0``, hashed): in the free queue and still in the hash index, so a
  later request can hit it; evicted (hash dropped) only when it is reused or its owner's cap needs room.
- **plain free** (``ref_cnt == 0``, no hash): in the free queue, reused first.

The free queue is ordered ``[plain free ...][cached free, least recently freed first]``. ``free``
appends a request's blocks deepest-first, so a shared short prefix is evicted after the longer tails
that hang off it. Cached capacity therefore grows and shrinks with load.

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
key (stored token ids compared), each following one as its predecessor's child under the block's
token bytes (the exact bytes its key hashes, so the dict's equality compare is the token compare),
so a hit block's key is read from the block instead of hashed; only the rest of the chain is hashed
(by the caller's ``keys``) and looked up key by key. Links exist only between indexed blocks
(``cache_blocks`` adds them for keys that continue their parent's chain, the walk heals missing
ones, every unindexing removes a block's links both ways); a link is a shortcut to the block that
holds the key the chain would give, never a second key, so namespaces, salts and exact-prefix
matching are the keys' as before.

**Listeners.** Every hash the pool drops is announced first to each callable in ``listeners`` as
``listener(block, reason)`` with ``reason`` one of ``"evicted"`` (reused by ``allocate``), ``"capped"``
(its owner's cap) or ``"flushed"`` (``drop_where``), while the block still holds its hash, tokens, tag
and bytes, so write-back, metrics and KV events are pushed, never polled. A listener must not call
back into the pool. After each operation that announced drops (an allocation's evictions, a flush, one
owner's cap trim), each callable in ``batch_listeners`` is called once with no arguments, so a listener
can batch per operation; inside a ``with pool.batch():`` block they are called once, at its end.

All methods are O(1) per block touched (``value_aware``: O(log n)) except ``allocate``'s eviction,
O(owners) per evicted block (``drop_where`` and ``check_integrity`` are O(index)/O(pool)). Not
thread-safe: the caller holds its lock around every call.
"""

from __future__ import annotations

import array
import itertools
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

from cachecore.errors import OutOfBlocks
from cachecore.eviction.base import EvictionPolicy, share, total_weight
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY, make_policy
from cachecore.free_queue import Block, FreeBlockQueue

__all__ = ["Block", "BlockPool", "FreeBlockQueue", "PoolStats"]

_is_block = partial(operator.is_not, None)  # C-level predicates and getters for whole-table walks
_token_ids = operator.attrgetter("token_ids")
_block_hash = operator.attrgetter("block_hash")

#: ``keys(blocks, parent_key)``: the chain keys of token blocks (``hit_prefix``).
KeyChain = Callable[[Sequence[bytes], "bytes | None"], list[bytes]]
_owner = operator.attrgetter("owner")


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
    eviction policy (a registered name or an instance of its own; ``fair_lru`` by default)."""

    def __init__(self, num_blocks: int, block_size: int,
                 policy: EvictionPolicy | str = DEFAULT_EVICTION_POLICY) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.stats = PoolStats()
        self._free = FreeBlockQueue(self.blocks)
        self._index: dict[bytes, Block] = {}
        # Per owner: cached blocks (held or free); the evictable ones are the policy's.
        self._owner_cached: Counter[str | None] = Counter()
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self._caps: dict[str, int] = {}
        self._num_cached_free = 0
        # Per owner: blocks it holds or keeps cached (what fair sharing protects), and its weight.
        self._usage: Counter[str] = Counter()
        self._weights: dict[str, int] = {}
        self._clock = 0  # stamps Block.freed_at
        self.listeners: list[Callable[[Block, str], None]] = []
        self.batch_listeners: list[Callable[[], None]] = []
        self._batch_depth = 0
        self._batch = _Batch(self)
        self.clock: Callable[[], float] = time.time  # the time of soft pins (``policy.pins``)

    # ------------------------------------------------------------------ accounting (read-only)
    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: plain free plus cached free (evictable)."""
        return self._free.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still in the index (evictable cache)."""
        return self._num_cached_free

    @property
    def num_in_use(self) -> int:
        """Blocks with ``ref_cnt > 0`` (protected)."""
        return self.num_blocks - self._free.num_free

    @property
    def num_cached(self) -> int:
        """Blocks in the index, held or free."""
        return len(self._index)

    def cached_tokens(self, owner: str | None) -> int:
        """Tokens ``owner`` keeps in the index (held and free blocks); what its cap limits."""
        return self._owner_cached[owner] * self.block_size

    def cap(self, owner: str) -> int | None:
        return self._caps.get(owner)

    def usage(self, owner: str) -> int:
        """Blocks ``owner`` holds or keeps cached: what its fair share protects."""
        return self._usage[owner]

    def protected(self, owner: str) -> int:
        """Blocks of ``owner`` that another owner's allocation may not evict now: its share of the pool
        among the owners with usage (``owner`` counted even when it has none yet)."""
        return share(self.num_blocks, owner, self._weights, total_weight(self._usage, self._weights, owner))

    def owners(self) -> list[str]:
        """Owners that hold or keep cached at least one block."""
        return [o for o, n in self._usage.items() if n > 0]

    def set_weight(self, owner: str, weight: int) -> None:
        """Weight of ``owner``'s fair share (default 1). Takes effect at the next allocation."""
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ValueError(f"weight must be an int >= 1, got {weight!r}")
        if weight == 1:
            self._weights.pop(owner, None)
        else:
            self._weights[owner] = weight

    def iter_free(self) -> Iterator[Block]:
        """Free blocks in queue order: plain ones (reused first), then cached ones least recently freed
        first (with ``fair_lru``, an owner's eviction order). O(num_free); for tests and debugging. Do
        not mutate the pool while iterating."""
        return iter(self._free)

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
        linking what it finds. Takes a reference on the first ``take`` blocks, as ``hit`` does.
        Returns (the blocks held, the length of the prefix found, the keys of every block)."""
        n_blocks = len(blocks)
        if not n_blocks:
            return [], 0, []
        index, bs = self._index, self.block_size
        hashes = keys(blocks[:1], None)
        found: list[Block] = []
        block = index.get(hashes[0])
        if block is not None:
            if block.token_ids == tuple(tokens[:bs]):
                keep = found.append
                keep(block)
                for link in itertools.islice(blocks, 1, None):
                    kids = block.children
                    if not kids:
                        break
                    block = kids.get(link)
                    if block is None:
                        break
                    keep(block)
                if len(found) > 1:
                    hashes = list(map(_block_hash, found))
            else:
                self.stats.collisions += 1
        k = len(found)
        if k < n_blocks:
            hashes += keys(blocks[max(k, 1):], hashes[-1])
        if 0 < k < n_blocks:
            self._follow_keys(found, tokens, blocks, hashes)
        held = found[:take] if take < len(found) else found
        if held:
            self._hold(held, 1)
        return held, len(found), hashes

    def _follow_keys(self, found: list[Block], tokens: Sequence[int], blocks: Sequence[bytes],
                     hashes: Sequence[bytes]) -> None:
        """Extend ``found`` (the linked prefix) by key lookups, token ids compared, linking each block
        found to its predecessor."""
        bs, k = self.block_size, len(found)
        more = list(itertools.takewhile(_is_block, map(self._index.get, itertools.islice(hashes, k, None))))
        if not more:
            return
        want = list(itertools.islice(zip(*[iter(tokens[k * bs :])] * bs, strict=False), len(more)))
        stored = list(map(_token_ids, more))
        if stored != want:
            n = next((i for i, (s, w) in enumerate(zip(stored, want, strict=False)) if s != w), len(want))
            if n < len(want):
                self.stats.collisions += 1
            del more[n:]
        prev = found[-1]
        for block, link in zip(more, itertools.islice(blocks, k, None), strict=False):
            if block.parent is None:
                self._link(prev, block, link)
            prev = block
        found += more

    # ------------------------------------------------------------------ reference counting
    def touch(self, blocks: Sequence[Block]) -> None:
        """Take one reference on each block. A free block leaves the free queue and keeps its hash.
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
        """One reference more on each held or cached block (``hits`` added to its reuse count)."""
        taken = []
        keep = taken.append
        for block in blocks:
            if not block.ref_cnt:
                # FreeBlockQueue.remove, inlined (the hot path of every hit)
                prev, nxt = block.prev_free, block.next_free
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                keep(block)
            block.ref_cnt += 1
            block.hits += hits
        if taken:
            self.policy.take(taken)
            self._free.num_free -= len(taken)
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
        queue = self._free
        out = queue.popleft_many(n - len(victims))  # plain free blocks: the head of the queue
        if victims:
            queue.remove_many(victims)
            self._evict(victims)
            out += victims
            self._batch_done()
        for block in out:
            block.ref_cnt = 1
        self._set_owners(out, owner)
        return out

    def _plan_evictions(self, n: int, owner: str) -> list[Block] | None:
        """The cached free blocks ``allocate(n, owner)`` would evict, in order (the policy's answer),
        or None if it cannot."""
        plain = self._free.num_free - self._num_cached_free
        need = n - min(n, plain)
        if need == 0:
            return []
        if need > self._num_cached_free:
            return None
        usage = Counter(self._usage)
        usage[owner] += n - need
        victims, protected = self.policy.victims(need, owner, usage, self._weights, self.num_blocks, self.clock)
        self.stats.protected_evictions += protected
        return victims

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference per entry. ``blocks`` is a block table, prefix first: blocks reaching 0
        enter the free queue deepest first (evicted first), hashed ones at the tail keeping hash and
        data, plain ones at the head. Owners over their cap then evict their own oldest free blocks.
        Raises ``ValueError`` (changing nothing) if a block would drop below zero."""
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
        queue = self._free
        for block in plain:
            self._set_owner(block, None)
            queue.appendleft(block)
        if not hashed:
            return
        queue.append_many(hashed)
        self._num_cached_free += len(hashed)
        self.policy.add(hashed)
        caps = self._caps
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
        cap = self._caps.get(owner)
        if cap is not None and (self._owner_cached[owner] + 1) * self.block_size > cap:
            held = self._owner_cached[owner] - self.policy.evictable(owner)
            if (held + 1) * self.block_size > cap:
                self.stats.cap_rejections += 1
                return block
            self._trim(owner, cap - self.block_size)
        self._index[block_hash] = block
        block.block_hash = block_hash
        block.token_ids = tokens
        block.tag = tag
        block.hits = 0
        self._set_owner(block, owner)
        self._owner_cached[owner] += 1
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
        capped = owner in self._caps
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
                        self._link(up, served, links[i])
                    up = served
                continue
            index[key] = block
            block.block_hash = key
            block.token_ids = toks
            block.tag = tag
            block.hits = 0
            if block.owner != owner:
                self._set_owner(block, owner)
            keep(block)
            indexed += 1
            if links is not None:
                if up is not None:  # _link, inlined
                    link = links[i]
                    kids = up.children
                    if kids is None:
                        up.children = kids = {}
                    kids[link] = block
                    block.parent = up
                    block.link = link
                up = block
        if indexed:
            self._owner_cached[owner] += indexed
        return new

    def set_cap(self, owner: str, max_tokens: int | None) -> None:
        """Limit the tokens ``owner`` keeps in the index (``None``: no cap). Lowering it evicts the
        owner's free blocks at once, oldest first; held blocks stay until freed."""
        if max_tokens is None:
            self._caps.pop(owner, None)
            return
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        self._caps[owner] = max_tokens
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

    def _drop(self, matches: list[Block], reason: str) -> int:
        for block in matches:
            was_free = block.ref_cnt == 0
            self._notify(block, reason)
            self._unindex(block, was_free=was_free)
            if was_free:
                self._set_owner(block, None)
                self._free.remove(block)
                self._free.appendleft(block)
        self.stats.dropped += len(matches)
        if matches:
            self._batch_done()
        return len(matches)

    def drop_owner(self, owner: str) -> int:
        """``drop_where`` for every block cached by ``owner``."""
        return self.drop_where(lambda b: b.owner == owner)

    # ------------------------------------------------------------------ internals
    def _notify(self, block: Block, reason: str) -> None:
        for listener in self.listeners:
            listener(block, reason)

    @property
    def in_batch(self) -> bool:
        """Inside a ``batch()`` block: ``batch_listeners`` wait for its end."""
        return self._batch_depth > 0

    def batch(self) -> _Batch:
        """``with pool.batch():`` makes one operation of several for ``batch_listeners`` (nestable)."""
        return self._batch

    def _batch_done(self) -> None:
        if not self._batch_depth:
            for listener in self.batch_listeners:
                listener()

    @staticmethod
    def _link(parent: Block, child: Block, link: bytes) -> None:
        kids = parent.children
        if kids is None:
            parent.children = kids = {}
        kids[link] = child
        child.parent = parent
        child.link = link

    @staticmethod
    def _unlink(block: Block) -> None:
        """Take a block leaving the index out of the chain links, both ways."""
        parent = block.parent
        if parent is not None:
            del parent.children[block.link]
            block.parent = block.link = None
        kids = block.children
        if kids:
            for child in kids.values():
                child.parent = child.link = None
        block.children = None

    def _set_owners(self, blocks: list[Block], owner: str) -> None:
        """``_set_owner`` for a whole allocation."""
        usage = self._usage
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

    def _evict(self, blocks: list[Block]) -> None:
        """Evict cached ``blocks`` that already left the free queue to be reused: each is announced
        (``"evicted"``) while it still holds its hash, then they leave the index and the policy."""
        listeners = self.listeners
        if listeners:
            for block in blocks:
                for listener in listeners:
                    listener(block, "evicted")
        self.policy.remove_many(blocks, evicted=True)
        index, unlink = self._index, self._unlink
        for block in blocks:
            del index[block.block_hash]
            block.block_hash = block.token_ids = block.tag = None
            if block.parent is not None or block.children:
                unlink(block)
        per_owner = Counter(map(_owner, blocks))
        owner_cached = self._owner_cached
        for owner, n in per_owner.items():
            left = owner_cached[owner] - n
            if left:
                owner_cached[owner] = left
            else:
                del owner_cached[owner]
        self._num_cached_free -= len(blocks)
        self.stats.evictions += len(blocks)
        self.stats.evictions_by_owner.update(per_owner)

    def _set_owner(self, block: Block, owner: str | None) -> None:
        if block.owner == owner:
            return
        if block.owner is not None:
            self._usage[block.owner] -= 1
            if not self._usage[block.owner]:
                del self._usage[block.owner]
        if owner is not None:
            self._usage[owner] += 1
        block.owner = owner

    def _unindex(self, block: Block, *, was_free: bool, evicted: bool = False) -> None:
        assert block.block_hash is not None
        del self._index[block.block_hash]
        owner = block.owner
        self._owner_cached[owner] -= 1
        if not self._owner_cached[owner]:
            del self._owner_cached[owner]
        if was_free:
            self.policy.remove(block, evicted=evicted)
            self._num_cached_free -= 1
        block.block_hash = None
        block.token_ids = None
        block.tag = None
        if block.parent is not None or block.children:
            self._unlink(block)

    def _count_eviction(self, block: Block) -> None:
        self.stats.evictions += 1
        self.stats.evictions_by_owner[block.owner] += 1

    def _trim(self, owner: str, max_tokens: int) -> None:
        """Evict ``owner``'s free blocks (the policy's order: ``fair_lru``, least recently freed first;
        pinned last) until it fits ``max_tokens`` or has none free."""
        if not self.policy.evictable(owner):
            return
        excess = self._owner_cached[owner] - max_tokens // self.block_size
        if excess <= 0:
            return
        for block in list(itertools.islice(self.policy.order(owner, self.clock), excess)):
            self._count_eviction(block)
            self.stats.cap_evictions += 1
            self._notify(block, "capped")
            self._unindex(block, was_free=True, evicted=True)
            self._set_owner(block, None)
            self._free.remove(block)
            self._free.appendleft(block)
        self._batch_done()

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Assert every invariant of the pool; raises ``AssertionError`` naming the first broken one.

        O(num_blocks + index); meant for tests and idle-time checks.
        """
        total, bs = self.num_blocks, self.block_size
        queue = self._free
        assert queue._head.prev_free is None and queue._tail.next_free is None, "sentinels linked outward"
        walked: list[Block] = []
        seen: set[int] = set()
        prev = queue._head
        node = queue._head.next_free
        while node is not queue._tail:
            assert node is not None, "free queue broken: ran off the end before the tail sentinel"
            assert node.prev_free is prev, f"free queue back link of {node} does not point at {prev}"
            assert node.block_id not in seen, f"{node} appears twice in the free queue"
            assert len(seen) <= total, "free queue longer than the pool (cycle?)"
            assert self.blocks[node.block_id] is node, f"free queue holds foreign block {node}"
            seen.add(node.block_id)
            walked.append(node)
            prev, node = node, node.next_free
        assert queue._tail.prev_free is prev, "tail sentinel back link is stale"
        assert len(walked) == queue.num_free, f"free queue walk {len(walked)} != num_free {queue.num_free}"

        in_use = 0
        for block in self.blocks:
            in_queue = block.block_id in seen
            assert block.ref_cnt >= 0, f"negative ref_cnt on {block}"
            assert (block.ref_cnt == 0) == in_queue, f"{block}: ref_cnt==0 must mean in free queue"
            if not in_queue:
                assert block.prev_free is None and block.next_free is None, f"held {block} still linked"
                in_use += 1
            assert (block.block_hash is None) == (block.token_ids is None), f"{block}: hash/tokens mismatch"
            if block.block_hash is not None:
                assert self._index.get(block.block_hash) is block, f"hashed {block} missing from index"
        assert len(walked) + in_use == total, f"free {len(walked)} + in use {in_use} != total {total}"

        recount: Counter[str | None] = Counter()
        for key, block in self._index.items():
            assert block.block_hash == key, f"index key {key.hex()[:8]} points at {block}"
            assert block.token_ids is not None and len(block.token_ids) == bs, f"{block}: bad token_ids"
            recount[block.owner] += 1
        assert recount == self._owner_cached, f"per-owner cached counts {dict(self._owner_cached)} != {dict(recount)}"

        # Queue shape: plain free blocks first, then cached ones; the policy's evictable blocks = these
        # (fair_lru: per owner, in queue order).
        cached_walk = [b for b in walked if b.block_hash is not None]
        first_cached = next((i for i, b in enumerate(walked) if b.block_hash is not None), len(walked))
        assert all(b.block_hash is not None for b in walked[first_cached:]), "plain free block behind a cached one"
        assert len(cached_walk) == self._num_cached_free, "num_cached_free out of sync"
        per_owner: dict[str | None, list[int]] = {}
        for block in cached_walk:
            per_owner.setdefault(block.owner, []).append(block.block_id)
        for owner in set(per_owner) | set(self.policy.owners()):
            n = len(per_owner.get(owner, ()))
            assert self.policy.evictable(owner) == n, f"policy counts {self.policy.evictable(owner)} evictable " \
                f"blocks of {owner!r}, the free queue {n}"
        self.policy.check({o: [self.blocks[i] for i in ids] for o, ids in per_owner.items()})

        usage: Counter[str] = Counter(
            b.owner for b in self.blocks if b.owner is not None and (b.ref_cnt > 0 or b.block_hash is not None)
        )
        assert usage == self._usage, f"per-owner usage {dict(self._usage)} != {dict(usage)}"
        for block in self.blocks:
            assert block.owner is not None or (block.ref_cnt == 0 and block.block_hash is None), \
                f"{block}: held or cached without an owner"

        for block in self.blocks:  # chain links: only between indexed blocks, both ways, under the tokens
            if block.block_hash is None:
                assert block.parent is None and not block.children, f"unindexed {block} still linked"
                continue
            if block.parent is not None:
                assert block.parent.children.get(block.link) is block, f"{block}: parent does not link back"
                assert block.link == array.array("I", block.token_ids).tobytes(), f"{block}: link is not its tokens"
            for link, child in (block.children or {}).items():
                assert child.parent is block and child.link == link, f"{block}: child {child} not linked back"

        for owner, cap in self._caps.items():
            assert recount[owner] * bs <= cap or owner not in per_owner, f"{owner!r} over cap with evictable blocks"
        self.policy.pins.check(bytes)


class _Batch:
    """``BlockPool.batch()``: ``batch_listeners`` are called once when the outermost block ends."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __enter__(self) -> None:
        self._pool._batch_depth += 1

    def __exit__(self, *exc: object) -> None:
        pool = self._pool
        pool._batch_depth -= 1
        pool._batch_done()
