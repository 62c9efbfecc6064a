"""One walk per request (BlockPool.hit_prefix, cache_blocks and the chain links) and the batched pool
paths: the same keys and hits as key-by-key lookups, never across namespaces or salts, links that
follow the index, and a free that fails changes nothing."""

from __future__ import annotations

import random

import pytest

from bench.prefix_index import make_request_schemes, shared_prefix_requests
from cachecore.block_pool import Block, BlockPool, FreeBlockQueue
from cachecore.engine import CacheEngine
from cachecore.eviction.fair_lru import FairLRU
from cachecore.hashing import block_keys, chain_hashes, token_blocks
from cachecore.layout import KVLayout
from cachecore.namespace import Namespace

BS = 4


def make_ns(salt: int = 0) -> Namespace:
    return Namespace.build(scope_salt=bytes([salt]) * 32, model_id="m", weight_digest="w", tokenizer_digest="t",
                           layout={"block_size": BS}, rope={"theta": 10000.0})


def make_engine(num_blocks: int = 64) -> CacheEngine:
    return CacheEngine(KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS), num_blocks, "cpu")


def run(engine: CacheEngine, ns: Namespace, tokens: list[int], **kw) -> int:
    seq = engine.admit(ns, tokens, owner="a", **kw)
    engine.mark_computed(seq, len(seq.tokens))
    engine.release(seq)
    engine.check_integrity()
    return seq.num_cached_tokens


def test_block_keys_of_token_blocks_are_chain_hashes():
    ns, rng = make_ns(), random.Random(3)
    for n in (0, 3, 4, 17, 40):
        tokens = [rng.randrange(2**32) for _ in range(n)]
        for salt in (b"", b"user"):
            want = chain_hashes(ns, tokens, BS, request_salt=salt)
            assert block_keys(ns, token_blocks(tokens, BS), request_salt=salt) == want
            if len(want) > 2:
                assert block_keys(ns, token_blocks(tokens, BS)[2:], parent=want[1]) == want[2:]
    assert token_blocks([0, 0, 0, 1], BS) == [b"\x00" * 12 + b"\x01\x00\x00\x00"]  # zero bytes kept


def test_hit_prefix_returns_the_same_keys_and_blocks_as_key_lookups():
    engine, ns = make_engine(), make_ns()
    prompt = list(range(100, 124))  # 6 blocks
    run(engine, ns, prompt)
    seq = engine.admit(ns, prompt[:20] + [7, 7, 7, 7, 7], owner="a")
    assert seq.hashes == chain_hashes(ns, seq.tokens, BS)
    assert seq.num_cached_tokens == 20
    assert [b.block_hash for b in seq.blocks[:5]] == seq.hashes[:5]
    # each hit block is the child of the one before it, under its exact token bytes
    links = token_blocks(prompt, BS)
    assert all(seq.blocks[i].parent is seq.blocks[i - 1] and seq.blocks[i].link == links[i] for i in range(1, 5))
    engine.release(seq)
    engine.check_integrity()


def test_links_never_cross_a_namespace_or_a_request_salt_and_other_tokens_miss():
    engine, ns = make_engine(), make_ns()
    prompt = list(range(200, 216))
    run(engine, ns, prompt)
    assert run(engine, ns, prompt) == 12  # same namespace, same salt: hits (last token recomputed)
    assert run(engine, make_ns(1), prompt) == 0  # another tenant's namespace
    assert run(engine, ns, prompt, request_salt=b"end-user") == 0
    other = prompt[:8] + [1, 2, 3, 4] + prompt[12:]
    assert run(engine, ns, other) == 8  # the changed block and everything after it miss


def test_a_block_evicted_from_the_middle_unlinks_and_a_reregistered_parent_is_linked_again():
    pool = BlockPool(8, BS)
    ns = make_ns()
    tokens = list(range(300, 312))  # 3 blocks
    tb = token_blocks(tokens, BS)
    keys = block_keys(ns, tb)

    def chain(run: list[bytes], parent: bytes | None) -> list[bytes]:
        return block_keys(ns, run, parent=parent)

    blocks = pool.allocate(3, "a")
    pool.cache_blocks(blocks, keys, tokens, "a", links=tb)
    assert blocks[1].parent is blocks[0] and blocks[2].parent is blocks[1]
    pool.free(blocks)
    pool.drop_hashes([keys[1]])  # the middle block leaves the index: both its links go
    pool.check_integrity()
    assert blocks[1].parent is None and blocks[2].parent is None and not blocks[0].children
    held, found, hashes = pool.hit_prefix(tokens, tb, chain, 3)
    assert (found, hashes) == (1, keys) and held == [blocks[0]]  # contiguous prefix only
    pool.free(held)
    again = pool.allocate(1, "a")
    pool.cache_blocks(again, keys[1:2], tokens[4:8], "a", parent=keys[0], links=tb[1:2])
    pool.free(again)
    held, found, _ = pool.hit_prefix(tokens, tb, chain, 3)
    assert found == 3 and held == [blocks[0], again[0], blocks[2]]
    assert blocks[2].parent is again[0]  # found by key, then linked to its new predecessor
    pool.free(held)
    pool.check_integrity()


def test_a_key_hit_whose_stored_tokens_differ_is_a_counted_miss():
    pool, ns = BlockPool(4, BS), make_ns()
    tokens = list(range(400, 408))
    tb = token_blocks(tokens, BS)
    keys = block_keys(ns, tb)
    blocks = pool.allocate(2, "a")
    pool.cache(blocks[0], keys[0], (9, 9, 9, 9), "a")  # the first key, other tokens
    pool.free(blocks)
    held, found, hashes = pool.hit_prefix(tokens, tb, lambda run, p: block_keys(ns, run, parent=p), 2)
    assert (held, found, hashes) == ([], 0, keys)
    assert pool.stats.collisions == 1


def test_cache_blocks_follows_cache_for_duplicates_and_caps():
    pool = BlockPool(8, BS)
    first = pool.allocate(2, "a")
    keys = [bytes([i]) * 32 for i in range(2)]
    tokens = list(range(8))
    assert pool.cache_blocks(first, keys, tokens, "a") == first
    second = pool.allocate(2, "a")
    assert pool.cache_blocks(second, keys, tokens, "a") == []  # duplicates: the first blocks serve
    assert pool.stats.duplicate_stores == 2 and all(b.block_hash is None for b in second)
    pool.set_cap("b", 0)
    third = pool.allocate(1, "b")
    assert pool.cache_blocks(third, [b"\x09" * 32], [1, 2, 3, 4], "b") == []
    assert pool.stats.cap_rejections == 1
    with pytest.raises(ValueError):
        pool.cache_blocks(third, [b"\x0a" * 32], [1, 2, 3], "b")
    pool.free(first + second + third)
    pool.check_integrity()


def test_a_failed_free_changes_no_reference_count():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2, "a")
    pool.touch([b])  # b: 2 references, a: 1
    with pytest.raises(ValueError):
        pool.free([a, b, b, a])  # a freed twice
    assert (a.ref_cnt, b.ref_cnt) == (1, 2)
    pool.check_integrity()
    pool.free([a, b, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free) == (0, 0, 4)
    pool.check_integrity()


def test_free_queue_many_forms_keep_the_order():
    blocks = [Block(i) for i in range(6)]
    queue = FreeBlockQueue(blocks[:4])
    assert [b.block_id for b in queue.popleft_many(2)] == [0, 1]
    queue.append_many([blocks[5], blocks[4]])
    assert queue.remove_many([blocks[3], blocks[5]]) == 2
    assert [b.block_id for b in queue] == [2, 4] and len(queue) == 2
    assert blocks[3].prev_free is None and blocks[0].next_free is None
    with pytest.raises(IndexError):
        queue.popleft_many(3)
    assert [b.block_id for b in queue] == [2, 4]


def test_a_single_owner_gives_its_own_order_and_the_general_path_agrees():
    class Entry:
        def __init__(self, owner: str, t: int) -> None:
            self.owner, self.freed_at, self.hits, self.block_hash = owner, t, 0, bytes([t])

    policy = FairLRU()
    entries = [Entry("a", t) for t in range(5)]
    policy.add(entries)
    assert policy.victims(3, "a", {"a": 5}, {}, 10, lambda: 0.0) == (entries[:3], 0)
    other = [Entry("b", t) for t in range(5, 7)]
    policy.add(other)  # two owners: the general path; "b" under its share, so "a" gives its own
    assert policy.victims(2, "a", {"a": 5, "b": 2}, {}, 10, lambda: 0.0) == (entries[:2], 0)
    policy.take(entries[:2] + other[:1])
    assert policy.evictable("a") == 3 and policy.evictable("b") == 1
    policy.remove_many(other[1:], evicted=True)
    assert policy.owners() == ["a"]


def test_the_benchmark_caches_serve_the_same_hits_with_evictions():
    requests = shared_prefix_requests(random.Random(5), count=120)
    schemes, reset = make_request_schemes(requests, 16, 1500)  # ~8K blocks asked of 1.5K: evictions
    reset()
    assert schemes["ours"]() == schemes["base"]() > 0
    assert schemes["ours_chain"]() == schemes["base_chain"]()
