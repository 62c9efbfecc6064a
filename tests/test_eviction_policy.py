"""The eviction policy seam (``cachecore.eviction``): the registry and its default, the fairness
invariant and pins under every registered policy, ``value_aware`` ordering victims differently from
``fair_lru``, weights counted in L3 (file backend) as in L1/L2, the engine config choosing the policy
of every tier, and a new policy being one class plus one registry entry."""

from __future__ import annotations

import random

import pytest
import torch

from cachecore.block_pool import BlockPool
from cachecore.config import EngineConfig
from cachecore.crypto import Keyring, generate_key
from cachecore.engine import CacheEngine
from cachecore.eviction.base import EvictionPolicy
from cachecore.eviction.fair_lru import FairLRU
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES, make_policy
from cachecore.eviction.value_aware import ValueAware
from cachecore.layout import KVLayout
from cachecore.tiers.backends import open_backend
from cachecore.tiers.base import Tag
from cachecore.tiers.host import HostStore
from cachecore.tiers.remote import RemoteStore
from cachecore.tiers.remote.capacity import L3Index
from tests.pool_blocks import BS, Clock, cache_free, has, key, toks

POLICIES = sorted(EVICTION_POLICIES)


def reuse(pool: BlockPool, xs: list[int]) -> None:
    """A request hitting the cached blocks of ``xs`` (prefix first) and releasing them."""
    blocks = [pool.get_cached(key(x), toks(x)) for x in xs]
    assert all(b is not None for b in blocks)
    pool.hit(blocks)
    pool.free(blocks)
    pool.check_integrity()


# ---------------------------------------------------------------------------- the registry
def test_the_registry_names_both_policies_and_fair_lru_is_the_default():
    assert {"fair_lru": FairLRU, "value_aware": ValueAware} == EVICTION_POLICIES
    assert DEFAULT_EVICTION_POLICY == "fair_lru"
    assert type(make_policy()) is FairLRU and type(make_policy("value_aware")) is ValueAware
    assert make_policy() is not make_policy()  # each store its own instance (a policy holds its state)
    assert type(BlockPool(4, BS).policy) is FairLRU
    assert EngineConfig().eviction_policy == "fair_lru"
    for bad in ("lru", "", None, 1):
        with pytest.raises(ValueError, match="eviction_policy must be one of fair_lru, value_aware"):
            make_policy(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="eviction_policy must be one of"):
            EngineConfig(eviction_policy=bad)  # type: ignore[arg-type]


def test_the_engine_config_chooses_the_policy_of_every_tier(tmp_path):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)
    store = RemoteStore(open_backend(f"file://{tmp_path / 'l3'}"), Keyring(), layout)
    assert type(store.eviction_policy) is FairLRU
    engine = CacheEngine(layout, num_blocks=8, config=EngineConfig(l2_blocks=8, eviction_policy="value_aware"),
                         l3=store)
    assert type(engine.pool.policy) is ValueAware and type(engine.l2.pool.policy) is ValueAware
    assert type(store.eviction_policy) is ValueAware
    assert engine.pool.policy is not engine.l2.pool.policy
    engine.set_weight("t", 3)  # share_weight reaches L3 too
    assert engine.pool.ledger.weights == engine.l2.pool.ledger.weights == {"t": 3} and store._index.weights == {"t": 3}
    engine.set_weight("t", None)
    assert store._index.weights == {}


def test_the_worker_reads_the_policy_from_its_environment(monkeypatch):
    from workers.config import WorkerConfig, WorkerConfigError

    monkeypatch.delenv("STRATA_EVICTION_POLICY", raising=False)
    assert WorkerConfig.from_env().engine(bytes_per_block=1).eviction_policy == "fair_lru"
    monkeypatch.setenv("STRATA_EVICTION_POLICY", "value_aware")
    assert WorkerConfig.from_env().engine(bytes_per_block=1).eviction_policy == "value_aware"
    monkeypatch.setenv("STRATA_EVICTION_POLICY", "lfu")
    with pytest.raises(WorkerConfigError, match="eviction_policy must be one of fair_lru, value_aware"):
        WorkerConfig.from_env()


def test_a_new_policy_is_one_class_and_one_registry_entry(monkeypatch):
    class NewestFirst(FairLRU):
        """Most recently freed first inside an owner; fairness inherited."""

        name = "newest_first"

        def order(self, owner, clock):
            return reversed(list(super().order(owner, clock)))

    monkeypatch.setitem(EVICTION_POLICIES, NewestFirst.name, NewestFirst)
    assert EngineConfig(eviction_policy="newest_first").eviction_policy == "newest_first"
    pool = BlockPool(4, BS, "newest_first")
    cache_free(pool, [1], "a")
    cache_free(pool, [2], "a")
    cache_free(pool, [3, 4], "a")
    cache_free(pool, [5], "a")  # evicts the most recently freed: 3 (4 was freed just before it)
    assert has(pool, 1) and has(pool, 2) and has(pool, 4) and not has(pool, 3)


# ---------------------------------------------------------------------------- every policy: fairness, pins
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("weight", [1, 3])
def test_a_flooding_tenant_never_takes_another_below_its_share(policy, weight):
    """b caches its share (and reuses some of it); a floods with requests of random lengths and
    random reuse. b's blocks all stay, whatever the policy orders inside a."""
    pool = BlockPool(16, BS, policy)
    pool.set_weight("b", weight)
    share_b = 16 * weight // (weight + 1)
    b_blocks = list(range(1, share_b + 1))
    cache_free(pool, b_blocks, "b")
    reuse(pool, b_blocks[:2])
    rng = random.Random(7)
    cached_a: list[list[int]] = []
    x = 1000
    for _ in range(200):
        if cached_a and rng.random() < 0.3:
            chain = rng.choice(cached_a)
            if all(has(pool, y) for y in chain):
                reuse(pool, chain)
                continue
        n = rng.randint(1, 16 - share_b)
        chain = list(range(x, x + n))
        x += n
        cache_free(pool, chain, "a")
        cached_a.append(chain)
        assert all(has(pool, y) for y in b_blocks), f"a's flood evicted b's protected blocks ({policy})"
        assert pool.usage("b") == share_b
    assert pool.protected("b") == share_b
    assert pool.stats.protected_evictions == 0 and pool.stats.evictions_by_owner["b"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_pins_hold_against_their_own_owners_flood_and_never_against_another_share(policy):
    pool = BlockPool(8, BS, policy)
    pool.clock = clock = Clock()
    cache_free(pool, [1, 2], "a")  # the named cache
    reuse(pool, [1, 2])
    cache_free(pool, [3, 4], "a")
    pool.pin([key(1), key(2)], clock.t + 60)
    for x in range(100, 160, 3):  # a's own flood
        cache_free(pool, [x, x + 1, x + 2], "a")
    assert has(pool, 1) and has(pool, 2) and not has(pool, 3) and not has(pool, 4)

    pool = BlockPool(8, BS, policy)
    pool.clock = clock = Clock()
    cache_free(pool, list(range(1, 9)), "a")  # a fills the pool and pins all of it
    pool.pin([key(x) for x in range(1, 9)], clock.t + 3600)
    cache_free(pool, [101, 102, 103, 104], "b")  # b's share comes out of a's pins
    assert pool.usage("a") == 4 and pool.usage("b") == 4 and pool.stats.protected_evictions == 0
    cache_free(pool, [105, 106], "b")  # at its share, a's pins hold: b evicts its own
    assert pool.usage("a") == 4
    clock.t += 3601  # lapsed: ordinary blocks again
    assert pool.pinned_tokens("a") == 0


# ---------------------------------------------------------------------------- value_aware's order
def test_value_aware_keeps_a_reused_block_that_lru_would_evict_first():
    """x is cached and reused three times, then y and z arrive (never reused). LRU evicts x (least
    recently freed); value_aware evicts y (worth least: no reuse), then z, and keeps x."""
    out = {}
    for policy in POLICIES:
        pool = BlockPool(3, BS, policy)
        cache_free(pool, [1], "a")
        for _ in range(3):
            reuse(pool, [1])
        cache_free(pool, [2], "a")
        cache_free(pool, [3], "a")
        cache_free(pool, [4], "a")  # one eviction
        out[policy] = [x for x in (1, 2, 3) if not has(pool, x)]
    assert out == {"fair_lru": [1], "value_aware": [2]}


def test_value_aware_evicts_a_chains_tail_before_its_prefix_and_ages_old_hits():
    pool = BlockPool(4, BS, "value_aware")
    cache_free(pool, [1, 2, 3, 4], "a")  # one chain: the tail goes first (a block without its prefix is dead)
    cache_free(pool, [10], "a")
    assert [has(pool, x) for x in (1, 2, 3, 4)] == [True, True, True, False]
    cache_free(pool, [11, 12], "a")
    assert [has(pool, x) for x in (1, 2, 3)] == [True, False, False]
    # aging: the floor rises with every eviction, so a block reused long ago loses to fresh ones
    policy = pool.policy
    assert isinstance(policy, ValueAware) and policy.floor > 0
    for i in range(30):
        cache_free(pool, [100 + 2 * i, 101 + 2 * i], "a")
    assert not has(pool, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_l2_store_runs_every_policy(policy):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)
    l2 = HostStore(layout, 4, pin_memory=False, eviction_policy=policy)
    tag = Tag("a", "m", "r1", b"\x00" * 32)
    for x in range(12):
        assert l2.put(key(x), toks(x), tag, torch.zeros(layout.page_shape, dtype=layout.torch_dtype))
        if x == 0:
            for _ in range(3):
                l2.get([(key(0), toks(0))])
    l2.check_integrity()
    assert l2.pool.num_cached == 4
    assert l2.contains(key(0), toks(0)) == (policy == "value_aware")  # reused: kept by value, not by LRU


# ---------------------------------------------------------------------------- L3: weights and policies
def _objects(index: L3Index, tenant: str) -> list[str]:
    return sorted(n for t, n, _ in index.entries() if t == tenant)


@pytest.mark.parametrize("policy", POLICIES)
def test_l3_index_answers_with_the_policy_and_weights(policy):
    index = L3Index(policy)
    index.load([])
    for i in range(6):
        index.remember("b", f"b/m/r/v1/{i:02x}", 10, float(i))
    for i in range(2):
        index.remember("a", f"a/m/r/v1/{i:02x}", 10, 100.0 + i)
    index.seen("b", "b/m/r/v1/00", 10, 0.0)  # b's oldest, read again: now its most recently used
    index.check()
    # equal weights: b (60 of 80) is over its share (40), a (30 with its write) is not
    assert index.victims("a", 10, 80) == [("b", "b/m/r/v1/01", 10)]
    index.set_weight("b", 3)  # b's share is 60 of 80, a's 20: a gives up its own oldest
    assert index.victims("a", 10, 80) == [("a", "a/m/r/v1/00", 10)]
    assert index.victims(None, 0, 80) == [] and index.victims("a", 90, 80) is None
    index.check()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("weight", [None, 3])
def test_a_weighted_tenant_keeps_its_larger_share_of_l3(tmp_path, policy, weight):
    """File backend, capacity of 8 objects. b writes 6, then a floods with 8. Equal weights: b's
    share is 4 of 8 and the flood takes it down to that. Weight 3 for b: its share is 6 of 8, and a
    evicts only its own objects."""
    from tests.test_l3 import CB, LAYOUT, _names, _put_all, _request, _tag

    ring = Keyring()
    for t in ("a", "b"):
        ring.add(t, 1, generate_key())
    store = RemoteStore(open_backend(f"file://{tmp_path / 'l3'}"), ring, LAYOUT, chunk_blocks=CB,
                        eviction_policy=policy)
    store.set_weight("b", weight)
    ns, tokens, hashes, kv = _request(21, 14 * CB)
    tb, ta = _tag(ns, owner="b"), _tag(ns, owner="a")
    ct = CB * LAYOUT.block_size
    assert store.put_chunk(hashes[:CB], tokens[:ct], tb, kv[:CB])
    size = store.stats["bytes_in"]
    store.capacity_bytes = 8 * size
    assert _put_all(store, hashes[CB : 6 * CB], tokens[ct : 6 * ct], tb, kv[CB : 6 * CB]) == 5
    b_names = _names(store, tb, hashes[: 6 * CB])
    for i in range(8):  # a's flood, one object at a time
        lo = 6 + i
        assert store.put_chunk(hashes[lo * CB : (lo + 1) * CB], tokens[lo * ct : (lo + 1) * ct], ta,
                               kv[lo * CB : (lo + 1) * CB])
    kept_b = [n for n in b_names if store.backend.exists(n)]
    usage = store.usage_by_tenant()
    if weight == 3:
        assert usage == {"a": 2 * size, "b": 6 * size} and kept_b == b_names
    else:
        assert usage == {"a": 4 * size, "b": 4 * size} and kept_b == b_names[2:]  # b's oldest went
    assert store.backend.usage() == 8 * size
    store.check_integrity()


def test_the_l3_policy_can_be_switched_keeping_objects_and_pins(tmp_path):
    from tests.test_l3 import CB, LAYOUT, _put_all, _request, _tag

    ring = Keyring()
    ring.add("a", 1, generate_key())
    store = RemoteStore(open_backend(f"file://{tmp_path / 'l3'}"), ring, LAYOUT, chunk_blocks=CB)
    ns, tokens, hashes, kv = _request(22, 3 * CB)
    assert _put_all(store, hashes, tokens, _tag(ns, owner="a"), kv) == 3
    keys = store.chunk_keys(hashes)
    store.pin(keys[:1], store.clock() + 60)
    store.use_eviction_policy("value_aware")
    assert isinstance(store.eviction_policy, EvictionPolicy) and store.eviction_policy.name == "value_aware"
    assert store.pinned(keys[0]) and store.eviction_policy.evictable(store._tenant_key("a")) == 3
    store.check_integrity()
