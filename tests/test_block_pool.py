"""BlockPool: ref counts, LRU eviction (deepest first), duplicates, collisions, caps, flush, integrity."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachecore.block_pool import Block, BlockPool, FreeBlockQueue
from cachecore.errors import OutOfBlocks

BS = 4


def toks(x: int) -> tuple[int, ...]:
    return tuple(x * 10 + i for i in range(BS))


def key(x: int) -> bytes:
    return hashlib.blake2b(str(x).encode(), digest_size=32).digest()


def cache_request(pool: BlockPool, xs: list[int], owner: str) -> list[Block]:
    """Allocate one block per x, cache it under key(x)/toks(x); returns the held block table."""
    blocks = pool.allocate(len(xs), owner)
    for block, x in zip(blocks, xs, strict=True):
        assert pool.cache(block, key(x), toks(x), owner) is block
    pool.check_integrity()
    return blocks


def hit(pool: BlockPool, x: int) -> bool:
    return pool.get_cached(key(x), toks(x)) is not None


# ---------------------------------------------------------------------------- free queue
def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    queue.remove(blocks[4])
    queue.append(blocks[4])
    assert [b.block_id for b in queue] == [2, 0, 1, 3, 4]
    assert queue.popleft() is blocks[2] and len(queue) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    for _ in range(4):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


# ---------------------------------------------------------------------------- allocate / free
def test_allocate_hands_out_distinct_held_blocks_and_out_of_blocks_changes_nothing():
    pool = BlockPool(4, BS)
    held = pool.allocate(3, "a")
    assert len({b.block_id for b in held}) == 3 and all(b.ref_cnt == 1 and b.owner == "a" for b in held)
    assert pool.num_free == 1 and pool.num_in_use == 3
    with pytest.raises(OutOfBlocks):
        pool.allocate(2, "a")
    assert pool.num_free == 1 and pool.num_in_use == 3
    pool.check_integrity()


def test_freed_cached_blocks_stay_hittable_until_reused():
    pool = BlockPool(2, BS)
    cache_request(pool, [1, 2], "a")
    pool.free(pool.blocks[:2])
    assert hit(pool, 1) and hit(pool, 2)
    assert pool.num_cached_free == 2 and pool.num_free == 2
    pool.allocate(1, "b")
    assert hit(pool, 1) and not hit(pool, 2)  # the deeper block went first
    assert pool.stats.evictions == 1 and pool.stats.evictions_by_owner["a"] == 1
    pool.check_integrity()


def test_free_orders_a_request_deepest_first_so_the_shared_prefix_survives_longest():
    pool = BlockPool(3, BS)
    table = cache_request(pool, [1, 2, 3], "a")
    pool.free(table)
    survivors = []
    for _ in range(3):
        pool.allocate(1, "a")  # the owner reclaiming its own cache: deepest first inside an owner
        survivors.append([x for x in (1, 2, 3) if hit(pool, x)])
    assert survivors == [[1, 2], [1], []]


def test_eviction_follows_free_order_across_requests():
    pool = BlockPool(4, BS)
    first = cache_request(pool, [1, 2], "a")
    second = cache_request(pool, [3, 4], "a")
    pool.free(second)
    pool.free(first)  # freed last: most recently used
    pool.allocate(2, "b")
    assert not hit(pool, 3) and not hit(pool, 4)
    assert hit(pool, 1) and hit(pool, 2)


def test_plain_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, BS)
    cached = cache_request(pool, [1], "a")
    plain = pool.allocate(1, "a")
    pool.free(cached)
    pool.free(plain)  # freed after the cached one, yet reused first
    assert pool.allocate(1, "a")[0] is plain[0]
    assert hit(pool, 1)
    pool.allocate(2, "a")  # the two never-used blocks
    assert hit(pool, 1)
    pool.allocate(1, "a")
    assert not hit(pool, 1)


def test_touch_protects_a_cached_block_from_eviction_and_reallocation():
    pool = BlockPool(3, BS)
    table = cache_request(pool, [1], "a")
    pool.free(table)
    block = pool.get_cached(key(1), toks(1))
    assert block is table[0]
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_hash == key(1) and pool.num_free == 2
    others = pool.allocate(2, "b")
    assert block not in others
    with pytest.raises(OutOfBlocks):
        pool.allocate(1, "b")
    assert hit(pool, 1)
    pool.check_integrity()


def test_touch_of_a_plain_free_block_and_over_free_raise_without_side_effects():
    pool = BlockPool(3, BS)
    held = pool.allocate(1, "a")
    plain = pool.blocks[2] if held[0] is not pool.blocks[2] else pool.blocks[1]
    with pytest.raises(ValueError):
        pool.touch([held[0], plain])
    assert held[0].ref_cnt == 1
    with pytest.raises(ValueError):
        pool.free([held[0], held[0]])
    assert held[0].ref_cnt == 1 and pool.num_in_use == 1
    pool.free(held)
    assert pool.num_in_use == 0
    pool.check_integrity()


# ---------------------------------------------------------------------------- index
def test_duplicate_store_returns_the_existing_block_and_indexes_once():
    pool = BlockPool(4, BS)
    original = cache_request(pool, [1], "a")[0]
    twin = pool.allocate(1, "b")[0]
    assert pool.cache(twin, key(1), toks(1), "b") is original
    assert twin.block_hash is None and pool.num_cached == 1
    assert pool.stats.duplicate_stores == 1
    fresh = pool.allocate(1, "b")[0]
    assert pool.cache(fresh, key(2), toks(2), "b") is fresh and pool.stats.duplicate_stores == 1
    assert pool.cache(original, key(1), toks(1), "a") is original  # re-caching is a no-op
    assert pool.stats.duplicate_stores == 1
    pool.check_integrity()


def test_hash_collision_is_caught_by_the_token_recheck():
    pool = BlockPool(4, BS)
    block = cache_request(pool, [1], "a")[0]
    assert pool.get_cached(key(1), toks(2)) is None  # same key, other tokens: forced collision
    assert pool.stats.collisions == 1
    assert pool.get_cached(key(1), toks(1)) is block
    assert pool.get_cached(key(1), list(toks(1))) is block  # any sequence type compares by value
    assert pool.get_cached(key(1), np.array(toks(1))) is block
    assert pool.get_cached(key(1), np.array(toks(2))) is None
    assert pool.stats.collisions == 2
    intruder = pool.allocate(1, "b")[0]
    assert pool.cache(intruder, key(1), toks(2), "b") is intruder
    assert intruder.block_hash is None and pool.get_cached(key(1), toks(1)) is block
    assert pool.stats.collisions == 3
    pool.check_integrity()


def test_cache_rejects_unheld_blocks_wrong_length_and_rekeying():
    pool = BlockPool(4, BS)
    block = pool.allocate(1, "a")[0]
    with pytest.raises(ValueError):
        pool.cache(block, key(1), toks(1)[:-1], "a")
    assert pool.cache(block, key(1), toks(1), "a") is block
    with pytest.raises(ValueError):
        pool.cache(block, key(2), toks(2), "a")
    with pytest.raises(ValueError):
        pool.cache(pool.blocks[3], key(3), toks(3), "a")
    pool.check_integrity()


# ---------------------------------------------------------------------------- caps
def _flood(pool: BlockPool, rounds: int = 200) -> None:
    for i in range(rounds):
        table = pool.allocate(4, "flood")
        for j, block in enumerate(table):
            pool.cache(block, key(1000 + 4 * i + j), toks(1000 + 4 * i + j), "flood")
        pool.free(table)
        pool.check_integrity()


def test_a_flooding_owner_cannot_evict_another_owners_share_without_any_setting():
    pool = BlockPool(32, BS)
    pool.free(cache_request(pool, [1, 2, 3], "victim"))  # hot prefix, well inside its half
    _flood(pool)
    assert all(hit(pool, x) for x in (1, 2, 3))
    assert pool.stats.evictions_by_owner["victim"] == 0 and pool.stats.evictions_by_owner["flood"] > 0
    assert pool.usage("flood") == 32 - 3  # the flood recycles its own blocks and the free surplus


def test_a_flood_takes_only_the_surplus_above_the_victims_share_least_recent_first():
    pool = BlockPool(16, BS)
    victim = list(range(1, 13))  # 12 blocks: 4 above its half once a second owner appears
    pool.free(cache_request(pool, victim, "victim"))
    _flood(pool, rounds=20)
    survivors = [x for x in victim if hit(pool, x)]
    assert survivors == victim[:8]  # the deepest 4 went, the first 8 (its protected share) stayed
    assert pool.usage("victim") == pool.protected("victim") == 8
    assert pool.stats.evictions_by_owner["victim"] == 4


def test_only_a_running_request_beyond_its_share_reaches_protected_blocks_and_it_is_counted():
    pool = BlockPool(4, BS)
    pool.free(cache_request(pool, [1, 2], "victim"))
    held = pool.allocate(2, "hog")  # the two plain blocks: the hog now holds its whole share
    assert pool.stats.protected_evictions == 0
    more = pool.allocate(1, "hog")  # a running request is never refused for idle cache: last resort
    assert pool.stats.protected_evictions == 1 and hit(pool, 1) and not hit(pool, 2)  # deepest went
    with pytest.raises(OutOfBlocks) as err:
        pool.allocate(2, "hog")  # only one block is not held
    assert not any(ch.isdigit() for ch in str(err.value))  # no pool-wide figures in the message
    pool.free(held + more)
    pool.check_integrity()


def test_weights_scale_the_protected_share():
    pool = BlockPool(12, BS)
    pool.set_weight("big", 2)
    pool.free(cache_request(pool, list(range(1, 9)), "big"))
    assert pool.protected("big") == 12  # alone, it may use the whole pool
    held = pool.allocate(4, "small")  # the four plain blocks
    assert pool.protected("big") == 8 and pool.protected("small") == 4
    assert pool.stats.protected_evictions == 0
    pool.set_weight("big", 1)
    assert len(pool.allocate(2, "small")) == 2  # equal shares now: big's surplus above 6 goes
    assert pool.usage("big") == 6 and pool.stats.protected_evictions == 0
    pool.free(held)
    with pytest.raises(ValueError):
        pool.set_weight("big", 0)


def test_capped_owner_keeps_to_its_cap_while_flooding():
    pool = BlockPool(32, BS)
    pool.set_cap("flood", 8 * BS)
    pool.free(cache_request(pool, [1, 2, 3], "victim"))
    _flood(pool)
    assert all(hit(pool, x) for x in (1, 2, 3))
    assert pool.stats.cap_evictions > 0 and pool.cached_tokens("flood") == 8 * BS


def test_cap_rejects_caching_when_the_owners_cached_blocks_are_all_held():
    pool = BlockPool(8, BS)
    pool.set_cap("a", 2 * BS)
    table = pool.allocate(3, "a")
    assert pool.cache(table[0], key(1), toks(1), "a") is table[0]
    assert pool.cache(table[1], key(2), toks(2), "a") is table[1]
    assert pool.cache(table[2], key(3), toks(3), "a") is table[2] and table[2].block_hash is None
    assert pool.stats.cap_rejections == 1 and pool.cached_tokens("a") == 2 * BS
    pool.free(table[:1])  # block 1 becomes evictable: the next store makes room by evicting it
    other = pool.allocate(1, "a")[0]
    assert pool.cache(other, key(4), toks(4), "a") is other and other.block_hash == key(4)
    assert not hit(pool, 1) and hit(pool, 4)
    assert pool.stats.cap_rejections == 1 and pool.stats.cap_evictions == 1
    pool.check_integrity()


def test_lowering_a_cap_evicts_only_that_owners_free_blocks_oldest_first():
    pool = BlockPool(16, BS)
    pool.free(cache_request(pool, [1, 2], "a"))
    pool.free(cache_request(pool, [3], "a"))
    held = cache_request(pool, [4], "a")
    pool.free(cache_request(pool, [5, 6], "b"))
    pool.set_cap("a", 2 * BS)
    assert [hit(pool, x) for x in (1, 2, 3, 4)] == [False, False, True, True]
    assert hit(pool, 5) and hit(pool, 6)
    pool.set_cap("a", 0)
    assert not hit(pool, 3) and hit(pool, 4)  # held blocks stay until freed
    pool.free(held)
    assert not hit(pool, 4) and pool.cached_tokens("a") == 0
    pool.set_cap("a", None)
    pool.free(cache_request(pool, [7], "a"))
    assert hit(pool, 7)
    pool.check_integrity()


# ---------------------------------------------------------------------------- flush
def test_drop_where_unindexes_held_blocks_but_leaves_them_held_and_frees_the_rest():
    pool = BlockPool(6, BS)
    held = cache_request(pool, [1, 2], "a")
    pool.free(cache_request(pool, [3], "a"))
    pool.free(cache_request(pool, [4], "b"))
    assert pool.drop_where(lambda b: b.owner == "a") == 3
    assert not any(hit(pool, x) for x in (1, 2, 3)) and hit(pool, 4)
    assert all(b.ref_cnt == 1 for b in held) and pool.num_in_use == 2
    assert pool.num_cached_free == 1 and pool.stats.dropped == 3
    pool.free(held)
    assert pool.num_cached_free == 1  # dropped blocks come back plain, not cached
    pool.check_integrity()
    assert pool.drop_owner("b") == 1 and not hit(pool, 4) and pool.num_cached == 0
    pool.check_integrity()


# ---------------------------------------------------------------------------- integrity
def test_check_integrity_catches_a_broken_free_queue_and_a_stale_index():
    pool = BlockPool(4, BS)
    pool.check_integrity()
    pool.blocks[2].next_free = pool.blocks[0]  # corrupt a link
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_integrity()

    pool = BlockPool(4, BS)
    block = cache_request(pool, [1], "a")[0]
    block.token_ids = toks(1)[:2]
    with pytest.raises(AssertionError, match="token_ids"):
        pool.check_integrity()



def test_check_integrity_catches_a_ledger_count_and_a_chain_link_out_of_step():
    pool = BlockPool(4, BS)
    cache_request(pool, [1], "a")
    pool.ledger.usage["a"] += 1  # a count the blocks do not back
    with pytest.raises(AssertionError, match="per-owner usage"):
        pool.check_integrity()

    pool = BlockPool(4, BS)
    first, second = cache_request(pool, [1, 2], "a")
    pool.index.link(first, second, b"not its tokens")
    with pytest.raises(AssertionError, match="link is not its tokens"):
        pool.check_integrity()


def test_the_pieces_of_the_pool_are_the_ones_it_reports_through():
    """The facade's views and the pieces behind it are one state: the index dict the tiers read inline
    (``pool._index``) is the index's own, and the counts the pool reports are the ledger's."""
    pool = BlockPool(8, BS)
    pool.set_weight("a", 3)
    pool.set_cap("a", 2 * BS)
    cache_request(pool, [1, 2], "a")
    assert pool._index is pool.index.by_hash and pool.num_cached == len(pool.index) == 2
    assert pool.ledger.weights == {"a": 3} and pool.cap("a") == pool.ledger.caps["a"] == 2 * BS
    assert pool.usage("a") == pool.ledger.usage["a"] == 2 and pool.cached_tokens("a") == 2 * BS
    assert [b for b in pool.iter_free() if b.block_hash is None] == list(pool.free_queue) and pool.num_free == 6
    pool.set_cap("a", None)
    assert pool.cap("a") is None and "a" not in pool.ledger.caps

# ---------------------------------------------------------------------------- stateful model check
OWNERS = ("a", "b", "c")
NUM_BLOCKS = 10


def weak_key(tokens: tuple[int, ...]) -> bytes:
    """Deliberately weak: depends on the first token only, so distinct blocks collide."""
    return bytes([tokens[0]]) * 32


TOKEN_CHOICES = [(f, s, 0, 0) for f in range(3) for s in range(2)]


class PoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a plain-Python reference model side by side.

    The model tracks ref counts, the index and the exact LRU order of cached free blocks, so every
    allocation can be checked to evict exactly the blocks the policy says (plain first, then least
    recently freed), and never a held one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, 4)
        self.requests: list[list[Block]] = []
        self.ref: dict[int, int] = {}
        self.index: dict[bytes, int] = {}
        self.hashed: dict[int, tuple[bytes, tuple[int, ...], str]] = {}
        self.lru: list[int] = []  # cached free block ids, least recently freed first
        self.caps: dict[str, int] = {}
        self.owner_of: dict[int, str] = {}  # blocks held or cached -> the owner they count for
        self.counts = {"evictions": 0, "duplicate_stores": 0, "collisions": 0, "cap_rejections": 0}

    # -- model helpers
    def owner_blocks(self, owner: str) -> int:
        return sum(1 for (_, _, o) in self.hashed.values() if o == owner)

    def model_unindex(self, block_id: int) -> None:
        h, _, _ = self.hashed.pop(block_id)
        del self.index[h]
        if block_id in self.lru:
            self.lru.remove(block_id)
        if block_id not in self.ref:
            del self.owner_of[block_id]

    def usage(self) -> Counter:
        return Counter(self.owner_of.values())

    @staticmethod
    def share(usage: Counter, allocator: str) -> int:
        active = {o for o, u in usage.items() if u > 0} | {allocator}
        return NUM_BLOCKS // len(active)

    def model_plan(self, n: int, owner: str) -> list[int] | None:
        """Fair sharing: plain blocks first; then the least recently freed block of an owner over
        its share; else the allocator's own; else refuse."""
        free = NUM_BLOCKS - len(self.ref)
        if n > free:
            return None
        need = n - min(n, free - len(self.lru))
        usage = self.usage()
        usage[owner] += n - need
        lru, victims = list(self.lru), []
        for _ in range(need):
            share = self.share(usage, owner)
            over = [b for b in lru if self.hashed[b][2] != owner and usage[self.hashed[b][2]] > share]
            own = [b for b in lru if self.hashed[b][2] == owner]
            victim = (over or own or lru)[0]  # last resort: anyone's least recently freed block
            victims.append(victim)
            lru.remove(victim)
            usage[self.hashed[victim][2]] -= 1
            usage[owner] += 1
        return victims

    def model_trim(self, owner: str, limit_tokens: int) -> None:
        for block_id in [b for b in self.lru if self.hashed[b][2] == owner]:
            if self.owner_blocks(owner) * 4 <= limit_tokens:
                break
            self.model_unindex(block_id)
            self.counts["evictions"] += 1

    # -- rules
    @rule(n=st.integers(0, 4), owner=st.sampled_from(OWNERS))
    def allocate(self, n: int, owner: str) -> None:
        expected_evicted = self.model_plan(n, owner)
        if expected_evicted is None:
            before = (self.pool.num_free, self.pool.num_cached)
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n, owner)
            assert (self.pool.num_free, self.pool.num_cached) == before
            return
        usage_before = self.usage()
        share_before = self.share(usage_before, owner)
        last_resorts = self.pool.stats.protected_evictions
        blocks = self.pool.allocate(n, owner)
        ids = [b.block_id for b in blocks]
        assert not set(ids) & set(self.ref), "a held block was handed out again"
        assert sorted(i for i in ids if i in self.hashed) == sorted(expected_evicted)
        for block_id in expected_evicted:
            self.model_unindex(block_id)
            self.counts["evictions"] += 1
        for block_id in ids:
            self.ref[block_id] = 1
            self.owner_of[block_id] = owner
        if blocks:
            self.requests.append(blocks)
        # The fairness property: another owner's allocation never pushes an owner below its share while
        # some owner is above its share or the allocator has evictable blocks of its own; only the last
        # resort (counted) may, when neither exists.
        usage_after = self.usage()
        if self.pool.stats.protected_evictions == last_resorts:
            for other in OWNERS:
                if other != owner:
                    assert usage_after[other] >= min(usage_before[other], share_before), (other, usage_before)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), choice=st.sampled_from(TOKEN_CHOICES), owner=st.sampled_from(OWNERS))
    def cache(self, data, choice: tuple[int, ...], owner: str) -> None:
        request = data.draw(st.sampled_from(self.requests))
        block = data.draw(st.sampled_from(request))
        if block.block_id in self.hashed:
            return
        h = weak_key(choice)
        result = self.pool.cache(block, h, choice, owner)
        if h in self.index:
            existing = self.index[h]
            if self.hashed[existing][1] == choice:
                self.counts["duplicate_stores"] += 1
                assert result.block_id == existing
            else:
                self.counts["collisions"] += 1
                assert result is block
            assert block.block_hash is None
            return
        cap = self.caps.get(owner)
        if cap is not None and (self.owner_blocks(owner) + 1) * 4 > cap:
            evictable = sum(1 for b in self.lru if self.hashed[b][2] == owner)
            if (self.owner_blocks(owner) - evictable + 1) * 4 > cap:
                self.counts["cap_rejections"] += 1
                assert result is block and block.block_hash is None
                return
            self.model_trim(owner, cap - 4)
        assert result is block and block.block_hash == h
        self.index[h] = block.block_id
        self.hashed[block.block_id] = (h, choice, owner)
        self.owner_of[block.block_id] = owner

    @rule(choice=st.sampled_from(TOKEN_CHOICES))
    def hit_and_touch(self, choice: tuple[int, ...]) -> None:
        h = weak_key(choice)
        found = self.pool.get_cached(h, choice)
        if h in self.index and self.hashed[self.index[h]][1] == choice:
            assert found is not None and found.block_id == self.index[h]
        else:
            if h in self.index:
                self.counts["collisions"] += 1
            assert found is None
            return
        self.pool.touch([found])
        if found.block_id in self.lru:
            self.lru.remove(found.block_id)
        self.ref[found.block_id] = self.ref.get(found.block_id, 0) + 1
        self.requests.append([found])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data) -> None:
        request = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.pool.free(request)
        over: set[str] = set()
        for block in reversed(request):
            self.ref[block.block_id] -= 1
            if self.ref[block.block_id] == 0:
                del self.ref[block.block_id]
                if block.block_id in self.hashed:
                    self.lru.append(block.block_id)
                    over.add(self.hashed[block.block_id][2])
                else:
                    del self.owner_of[block.block_id]
        for owner in over:
            if owner in self.caps:
                self.model_trim(owner, self.caps[owner])

    @rule(owner=st.sampled_from(OWNERS), cap=st.none() | st.integers(0, 6).map(lambda n: n * 4))
    def set_cap(self, owner: str, cap: int | None) -> None:
        self.pool.set_cap(owner, cap)
        if cap is None:
            self.caps.pop(owner, None)
        else:
            self.caps[owner] = cap
            self.model_trim(owner, cap)

    @rule(first=st.integers(0, 2))
    def drop(self, first: int) -> None:
        dropped = self.pool.drop_where(lambda b: b.token_ids is not None and b.token_ids[0] == first)
        matches = [b for b, (_, t, _) in self.hashed.items() if t[0] == first]
        assert dropped == len(matches)
        for block_id in matches:
            self.model_unindex(block_id)

    # -- after every step
    @invariant()
    def pool_matches_model(self) -> None:
        pool = self.pool
        pool.check_integrity()
        assert pool.num_in_use == len(self.ref) and pool.num_free == NUM_BLOCKS - len(self.ref)
        assert pool.num_cached_free == len(self.lru) and pool.num_cached == len(self.index)
        assert [b.block_id for b in pool.iter_free() if b.block_hash is not None] == self.lru
        for block in pool.blocks:
            assert block.ref_cnt == self.ref.get(block.block_id, 0)
            expected = self.hashed.get(block.block_id)
            assert block.block_hash == (expected[0] if expected else None), f"{block} vs model {expected}"
        usage = self.usage()
        for owner in OWNERS:
            assert pool.cached_tokens(owner) == self.owner_blocks(owner) * 4
            assert pool.usage(owner) == usage[owner]
        stats = pool.stats
        assert stats.evictions == self.counts["evictions"]
        assert stats.duplicate_stores == self.counts["duplicate_stores"]
        assert stats.collisions == self.counts["collisions"]
        assert stats.cap_rejections == self.counts["cap_rejections"]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
