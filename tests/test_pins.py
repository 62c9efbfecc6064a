"""Named caches, engine side: soft pins in the block pool (L1, L2) and in L3, the engine's
resident / pin / drop, and the reference worker's prewarm / cache_pin / cache_drop / cache_resident.

Pins survive their own tenant's flood while an unpinned prefix is evicted; lapsed pins decay into
plain LRU order; a pin never takes another tenant below its fair share; a drop removes the bytes
from every tier (files on disk, Redis keys); a completion after prewarm hits, after drop misses,
with the same greedy tokens either way."""

from __future__ import annotations

import base64
import os
import secrets

import pytest
import torch

from cachecore.block_pool import BlockPool
from cachecore.crypto import Keyring, generate_key
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.tiers.backends import open_backend
from cachecore.tiers.base import Tag
from cachecore.tiers.host import HostStore
from cachecore.tiers.remote import RemoteStore
from tests.l3_workers import L3Site
from tests.pool_blocks import BS, Clock, cache_free, has, key, toks
from tests.test_l3 import redis_server, redis_up  # noqa: F401  (fixtures: a real redis-server)
from tests.worker_calls import complete
from workers.cache_worker import CacheWorker
from workers.config import WorkerConfig


def _pool(n: int = 8) -> tuple[BlockPool, Clock]:
    pool = BlockPool(n, BS)
    pool.clock = clock = Clock()
    return pool, clock


# ---------------------------------------------------------------------------- the pool
def test_pinned_blocks_survive_their_own_owners_flood_while_unpinned_ones_go():
    pool, clock = _pool(8)
    cache_free(pool, [1, 2], "a")  # the named cache (oldest: evicted first without a pin)
    cache_free(pool, [3, 4], "a")  # an ordinary prefix
    pool.pin([key(1), key(2)], clock.t + 60)
    assert pool.pinned_tokens("a") == 2 * BS and pool.is_pinned(key(1))
    for x in range(100, 160, 3):  # a's own flood
        cache_free(pool, [x, x + 1, x + 2], "a")
    assert has(pool, 1) and has(pool, 2)
    assert not has(pool, 3) and not has(pool, 4)
    assert pool.pinned_tokens("a") == 2 * BS


def test_a_block_registered_later_under_a_pinned_hash_is_pinned():
    pool, clock = _pool(6)
    pool.pin([key(7)], clock.t + 60)  # pinned before it exists (promoted or re-stored later)
    cache_free(pool, [7], "a")
    for x in range(100, 130, 5):
        cache_free(pool, list(range(x, x + 5)), "a")
    assert has(pool, 7)
    assert pool.unpin([key(7)]) == 1 and not pool.is_pinned(key(7))
    cache_free(pool, list(range(200, 206)), "a")
    assert not has(pool, 7)


def test_lapsed_pins_decay_into_plain_lru_order():
    pool, clock = _pool(3)
    cache_free(pool, [1], "a")
    cache_free(pool, [2, 3], "a")
    pool.pin([key(1)], clock.t + 10)
    cache_free(pool, [10, 11], "a")  # evicts 2 and 3, keeps the pinned 1
    assert has(pool, 1) and not has(pool, 2)
    clock.t += 11  # the pin lapsed: 1 is the least recently freed block again
    assert not pool.is_pinned(key(1)) and pool.pinned_tokens("a") == 0
    cache_free(pool, [20], "a")
    assert not has(pool, 1) and has(pool, 10) and has(pool, 11)
    pool.check_integrity()


def test_a_pin_never_takes_another_tenant_below_its_fair_share():
    pool, clock = _pool(8)
    cache_free(pool, list(range(1, 9)), "a")  # a fills the pool and pins all of it
    pool.pin([key(x) for x in range(1, 9)], clock.t + 3600)
    cache_free(pool, [101, 102, 103, 104], "b")  # b's share (4 of 8) comes out of a's pins
    assert all(has(pool, x) for x in (101, 102, 103, 104))
    assert pool.usage("a") == 4 and pool.usage("b") == 4
    assert pool.stats.protected_evictions == 0
    # now at its share, a's pins hold against b: b's next allocation evicts b's own blocks (deepest first)
    cache_free(pool, [105, 106], "b")
    assert pool.usage("a") == 4 and not has(pool, 104) and not has(pool, 103) and has(pool, 101)


def test_a_pinned_owner_over_its_share_gives_up_unpinned_blocks_first():
    pool, clock = _pool(8)
    cache_free(pool, [1, 2, 3], "a")  # pinned
    cache_free(pool, [4, 5, 6, 7, 8], "a")  # unpinned, more recent
    pool.pin([key(1), key(2), key(3)], clock.t + 3600)
    cache_free(pool, [101, 102, 103], "b")  # a's unpinned blocks go, deepest first
    assert all(has(pool, x) for x in (1, 2, 3, 4, 5)) and not any(has(pool, x) for x in (6, 7, 8))


def test_cap_trims_unpinned_blocks_first():
    pool, clock = _pool(8)
    cache_free(pool, [1, 2], "a")
    cache_free(pool, [3, 4, 5], "a")
    pool.pin([key(1), key(2)], clock.t + 60)
    pool.set_cap("a", 3 * BS)
    assert has(pool, 1) and has(pool, 2) and has(pool, 3)
    assert not has(pool, 4) and not has(pool, 5)
    pool.check_integrity()


def test_drop_hashes_unindexes_free_and_held_blocks_and_held_ones_stay_usable():
    pool, _ = _pool(6)
    cache_free(pool, [1, 2], "a")
    held = pool.allocate(1, "a")
    pool.cache(held[0], key(3), toks(3), "a")
    assert pool.drop_hashes([key(1), key(3), key(99)]) == 2
    assert not has(pool, 1) and has(pool, 2) and not has(pool, 3)
    assert held[0].ref_cnt == 1 and held[0].block_hash is None  # still its request's, never a hit
    pool.check_integrity()
    pool.free(held)
    assert pool.drop_hashes([key(1), key(3)]) == 0
    pool.check_integrity()


# ---------------------------------------------------------------------------- L2 and L3 stores
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)


def _tag(owner: str) -> Tag:
    return Tag(owner, "m", "r1", b"\x00" * 32)


def _kv(seed: int, n: int = 1) -> torch.Tensor:
    return torch.randn((n, *LAYOUT.page_shape), generator=torch.Generator().manual_seed(seed)).to(LAYOUT.torch_dtype)


def test_l2_pins_survive_the_tenants_flood():
    l2 = HostStore(LAYOUT, 6, pin_memory=False)
    for x in (1, 2, 3, 4):
        assert l2.put(key(x), toks(x), _tag("a"), _kv(x))
    l2.pin([key(1), key(2)], 10**12)
    for x in range(100, 140):
        l2.put(key(x), toks(x), _tag("a"), _kv(x))
    assert l2.prefix([(key(1), toks(1)), (key(2), toks(2)), (key(3), toks(3))]) == 2
    assert l2.pool.pinned_tokens("a") == 2 * BS
    assert l2.drop_keys([key(1), key(2)]) == 2 and l2.prefix([(key(1), toks(1))]) == 0
    assert l2.pool.pinned_tokens("a") == 0
    l2.check_integrity()


CB = 2  # blocks per L3 chunk here


def _store(backend, capacity_chunks: int | None = None, clock=None) -> RemoteStore:
    ring = Keyring()
    for t in ("a", "b"):
        ring.add(t, 1, generate_key())
    store = RemoteStore(backend, ring, LAYOUT, chunk_blocks=CB, clock=clock or Clock())
    if capacity_chunks is not None:
        store.capacity_bytes = capacity_chunks * store._frame_bytes
    return store


def _chain(seed: int, chunks: int, salt: bytes = b"\x01" * 32):
    from tests.test_l3 import _ns

    tokens = torch.randint(0, 2**20, (chunks * CB * BS,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tokens, chain_hashes(_ns(salt, layout=LAYOUT), tokens, BS)


def _put(store: RemoteStore, owner: str, seed: int, chunks: int = 1):
    tokens, hashes = _chain(seed, chunks)
    for c in range(chunks):
        assert store.put_chunk(hashes[c * CB:(c + 1) * CB], tokens[c * CB * BS:(c + 1) * CB * BS], _tag(owner),
                               _kv(seed + c, CB))
    store.clock.t += 1  # age order by write time
    return tokens, hashes


@pytest.fixture(params=["fs", "redis"])
def backend(request, tmp_path):
    if request.param == "fs":
        yield open_backend((tmp_path / "l3").as_uri())
    else:
        server = request.getfixturevalue("redis_up")
        yield open_backend(server.url)


def test_l3_pins_survive_the_tenants_flood_and_decay(backend):
    store = _store(backend, capacity_chunks=4)
    pinned = _put(store, "a", 1)
    plain = _put(store, "a", 2)
    store.pin(store.chunk_keys(pinned[1]), store.clock.t + 100)
    for s in range(10, 16):  # a's own flood
        _put(store, "a", s)
    assert store.probe(pinned[1], _tag("a")) == CB
    assert store.probe(plain[1], _tag("a")) == 0
    assert store.pinned(pinned[1][-1])
    store.clock.t += 200  # lapsed: the oldest object goes next
    _put(store, "a", 50)
    assert store.probe(pinned[1], _tag("a")) == 0
    store.check_integrity()


def test_l3_pin_never_takes_another_tenant_below_its_share(backend):
    store = _store(backend, capacity_chunks=4)
    mine = [_put(store, "a", s) for s in range(1, 5)]  # a fills L3 and pins it all
    for _, hashes in mine:
        store.pin(store.chunk_keys(hashes), store.clock.t + 3600)
    theirs = [_put(store, "b", s) for s in (20, 21)]
    assert all(store.probe(h, _tag("b")) == CB for _, h in theirs)
    assert sum(store.probe(h, _tag("a")) == CB for _, h in mine) == 2
    assert store.usage_by_tenant() == {"a": 2 * store._frame_bytes, "b": 2 * store._frame_bytes}


def test_l3_delete_keys_removes_the_bytes_from_the_backend(backend):
    store = _store(backend)
    tokens, hashes = _put(store, "a", 7, chunks=3)
    other = _put(store, "a", 8)
    store.pin(store.chunk_keys(hashes), store.clock.t + 100)
    names = [info.name for info in backend.list("")]
    assert len(names) == 4
    objects, n_bytes = store.delete_keys(_tag("a"), store.chunk_keys(hashes))
    assert objects == 3 and n_bytes == 3 * store._frame_bytes
    left = [info.name for info in backend.list("")]
    assert left == [n for n in names if n.endswith(other[1][-1].hex())]
    for name in names:
        if name not in left:
            assert backend.get(name) is None and not backend.exists(name)
    assert not store.pinned(hashes[-1])
    assert store.delete_keys(_tag("a"), store.chunk_keys(hashes)) == (0, 0)
    assert store.probe(hashes, _tag("a")) == 0 and store.probe(other[1], _tag("a")) == CB
    store.check_integrity()


# ---------------------------------------------------------------------------- the reference worker
@pytest.fixture
def site(tmp_path):
    s = L3Site(tmp_path)
    # the session's STRATA_MASTER_KEY (tests/conftest.py) wins over a key file
    s.master = base64.b64decode(os.environ["STRATA_MASTER_KEY"])
    return s


def _worker(site: L3Site, *, l1_mb: int = 8, l2_mb: int = 4) -> CacheWorker:
    cfg = WorkerConfig(l1_mb=l1_mb, l2_mb=l2_mb, l3_url=site.l3.as_uri(), master_key_file=str(site.key_file),
                       torch_threads=1, load_policy="always_load")
    return CacheWorker(deployment="pins", preset="tiny", revision={"label": "r1", "seed": 5}, device="cpu", config=cfg)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(worker: CacheWorker, req: dict, **kw) -> dict:
    out = complete(worker, {**req, **kw})
    assert "error" not in out, out
    worker.drain_writes()
    return out


def test_prewarm_pin_hit_drop_miss_on_the_reference_worker(site):
    worker = _worker(site)
    salt = secrets.token_bytes(32)
    prompt = _prompt(300, 1)  # 18 full blocks, one 256-token L3 chunk
    req = site.request("t1", prompt, scope_salt=salt)
    cold = _complete(worker, req, max_tokens=8, use_cache=False)
    assert cold["usage"]["cached_tokens"] == 0

    until = 2e9
    warm = worker.prewarm(req, until)
    assert warm.pop("usage")["prompt_tokens"] == 300
    assert warm == {"tokens": 300, "cached_tokens": 0, "tiers": {"l1": 288, "l2": 288, "l3": 256}, "pinned": True}
    assert worker.cache_resident(req) == {"tiers": {"l1": 288, "l2": 288, "l3": 256}}
    assert worker.engine.pool.pinned_tokens("t1") == 288
    assert worker.engine.l2.pool.pinned_tokens("t1") == 288
    assert site.files("t1")
    worker.check_integrity()

    hit = _complete(worker, req, max_tokens=8)
    assert hit["usage"]["cached_tokens"] == 288
    assert hit["token_ids"] == cold["token_ids"]
    # another cache_salt computes other keys: the named cache is not its own
    assert worker.cache_resident({**req, "cache_salt": "u2"}) == {"tiers": {"l1": 0, "l2": 0, "l3": 0}}

    assert worker.cache_pin(req, None) == {"tiers": {"l1": 288, "l2": 288, "l3": 256}}
    assert worker.engine.pool.pinned_tokens("t1") == 0
    assert worker.cache_pin(req, until)["tiers"]["l2"] == 288

    bpb = worker.engine.layout.bytes_per_block
    files = site.files("t1")
    l3_bytes = sum(f.stat().st_size for f in files)
    dropped = worker.cache_drop(req)
    assert dropped == {"tiers": {"l1": 18, "l2": 18, "l3": 1}, "bytes": 36 * bpb + l3_bytes}
    assert not any(f.exists() for f in files)
    assert worker.cache_resident(req) == {"tiers": {"l1": 0, "l2": 0, "l3": 0}}
    assert worker.engine.pool.pinned_tokens("t1") == 0 and not worker.engine.l2.pool._pins
    assert worker.cache_drop(req) == {"tiers": {"l1": 0, "l2": 0, "l3": 0}, "bytes": 0}
    worker.check_integrity()

    miss = _complete(worker, req, max_tokens=8, persist=False)  # persist=False: nothing new in L3
    assert miss["usage"]["cached_tokens"] == 0
    assert miss["token_ids"] == cold["token_ids"]
    worker.check_integrity()


def test_prewarmed_prefix_survives_the_tenants_own_flood_in_l1_and_l2(site):
    worker = _worker(site, l1_mb=1, l2_mb=1)
    salt = secrets.token_bytes(32)
    named = site.request("t1", _prompt(200, 2), scope_salt=salt, persist=False)
    plain = site.request("t1", _prompt(200, 3), scope_salt=salt, persist=False)
    assert worker.prewarm(named, 2e9)["tiers"]["l2"] == 192
    assert worker.prewarm(plain, None)["pinned"] is False
    l1, l2 = worker.engine.pool.num_blocks, worker.engine.l2.pool.num_blocks
    for s in range(10, 10 + 2 * (l1 + l2) // 12 + 2):  # t1's own traffic, several times L1 + L2
        _complete(worker, {**plain, "prompt": _prompt(200, s)}, max_tokens=1)
    assert worker.cache_resident(named)["tiers"]["l2"] == 192
    assert worker.cache_resident(plain)["tiers"] == {"l1": 0, "l2": 0, "l3": 0}
    assert _complete(worker, named, max_tokens=1)["usage"]["cached_tokens"] == 192
    worker.check_integrity()


def test_prewarm_reports_a_failed_run_as_an_error(site):
    worker = _worker(site)
    out = worker.prewarm(site.request("t1", [], scope_salt=secrets.token_bytes(32)), 2e9)
    assert set(out) == {"error"} and set(out["error"]) == {"code", "message", "retryable"}
    busy = site.request("t1", _prompt(40, 4), scope_salt=secrets.token_bytes(32))
    assert worker.prewarm({**busy, "max_concurrent_requests": 0}, None)["error"]["code"] == "tenant_busy"
    worker.check_integrity()


def test_named_cache_ops_are_delegated_by_the_actor():
    from workers.actor import _DELEGATED, CacheWorkerActor

    for name in ("prewarm", "cache_pin", "cache_drop", "cache_resident"):
        assert name in _DELEGATED and callable(getattr(CacheWorkerActor, name))

