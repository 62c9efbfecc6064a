"""KV events: every tier announces what it stores and removes, in batches with a per-replica seq that
grows by one; the ring buffer reports gaps; the snapshot is the state after its seq; the worker
serves them (``kv_events``, ``kv_snapshot``) with its replica id, namespace fields and router stats."""

from __future__ import annotations

import secrets

import pytest
import torch

from cachecore import crypto
from cachecore.config import EngineConfig
from cachecore.engine import CacheEngine
from cachecore.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventLog,
    InvalidEvent,
    event_from_dict,
)
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.namespace import Namespace
from cachecore.routing.index import PrefixIndex
from cachecore.tiers.backends import open_backend
from cachecore.tiers.remote import RemoteStore

BS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype="float32")
H = [bytes([i]) * 32 for i in range(40)]


def _ns(salt: bytes | None = None) -> Namespace:
    return Namespace.build(scope_salt=salt or secrets.token_bytes(32), model_id="m", weight_digest="w",
                           tokenizer_digest="t", layout=LAYOUT.canonical(), rope={"theta": 10000.0})


def _engine(*, l1=8, l2=0, l3=None, log=None) -> tuple[CacheEngine, EventLog]:
    log = log or EventLog("dep:0:boot")
    return CacheEngine(LAYOUT, num_blocks=l1, config=EngineConfig(l2_blocks=l2), l3=l3, events=log), log


def _tokens(blocks: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (blocks * BS,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv(blocks: int) -> torch.Tensor:
    return torch.randn(blocks, *LAYOUT.page_shape)


def _store(engine, ns, tokens, owner="t") -> list[bytes]:
    engine.store(ns, tokens, _kv(len(tokens) // BS), owner=owner, model="m", revision="r")
    return chain_hashes(ns, tokens, BS)


def _events(log, since=0):
    batches, gap = log.since(since)
    assert not gap
    return [(type(e).__name__, e.tier, getattr(e, "reason", None), getattr(e, "hashes", ()))
            for b in batches for e in b.events]


def _replayed(log) -> dict[str, set[bytes]]:
    """Every tier's hashes by applying the log's batches from seq 1 to an empty index."""
    index = PrefixIndex()
    batches, gap = log.since(0, limit=10_000)
    assert not gap
    for b in batches:
        assert index.apply(EventBatch.from_dict(b.to_dict()))
    return index.held(log.replica_id)


# ---------------------------------------------------------------------- the typed events
def test_batches_round_trip_through_their_json_form():
    batch = EventBatch("dep:1:ab", 7, 12.5, (BlockStored("l1", (H[0], H[1])), BlockRemoved("l2", (H[2],), "evicted"),
                                               AllCleared("l3"), AllCleared(None)))
    d = batch.to_dict()
    assert d["events"][0] == {"type": "stored", "tier": "l1", "hashes": [H[0].hex(), H[1].hex()]}
    assert EventBatch.from_dict(d) == batch
    assert EventBatch.from_dict({**d, "seq": 8}) != batch


@pytest.mark.parametrize("bad", [
    {"type": "stored", "tier": "l4", "hashes": []},
    {"type": "stored", "tier": "l1", "hashes": ["zz"]},
    {"type": "stored", "tier": "l1", "hashes": ["ab"]},  # not 32 bytes
    {"type": "removed", "tier": "l1", "hashes": [], "reason": "because"},
    {"type": "renamed", "tier": "l1"},
    "stored",
])
def test_malformed_events_are_typed_errors(bad):
    with pytest.raises(InvalidEvent):
        event_from_dict(bad)
    assert event_from_dict({"type": "removed", "tier": "l1", "hashes": [H[0].hex()], "reason": "flushed"}) \
        == BlockRemoved("l1", (H[0],), "flushed")


def test_malformed_batches_are_typed_errors():
    good = EventBatch("r", 1, 0.0, ()).to_dict()
    assert EventBatch.from_dict(good).seq == 1
    for bad in ({**good, "seq": 0}, {**good, "seq": True}, {**good, "replica_id": ""}, {**good, "events": None}, []):
        with pytest.raises(InvalidEvent):
            EventBatch.from_dict(bad)


# ---------------------------------------------------------------------- the log
def test_seq_grows_by_one_per_batch_and_empty_batches_are_not_published():
    log = EventLog("r")
    assert log.publish(BlockStored("l1", ())) is None and log.seq == 0
    assert log.publish(BlockStored("l1", (H[0],))) == 1
    assert log.publish(BlockRemoved("l1", (H[0],), "evicted"), BlockStored("l2", (H[0],))) == 2
    batches, gap = log.since(0)
    assert [b.seq for b in batches] == [1, 2] and not gap
    assert [b.seq for b in log.since(1)[0]] == [2]
    assert log.since(2) == ([], False)


def test_a_consumer_behind_the_ring_buffer_gets_a_gap_and_reconciles_from_the_snapshot():
    log = EventLog("r", capacity=4)
    for i in range(10):
        log.publish(BlockStored("l1", (H[i],)))
    log.publish(BlockRemoved("l1", (H[3],), "evicted"))
    assert log.since(2) == ([], True)  # batch 3 is gone
    assert [b.seq for b in log.since(7)[0]] == [8, 9, 10, 11]
    assert log.since(12) == ([], True)  # a seq this log never issued
    index = PrefixIndex()
    assert index.apply(log.since(7)[0][0]) is False  # the index never saw 1..7: a gap
    index.reconcile(log.snapshot())
    assert index.expected_seq("r") == 12
    assert index.holds("r", H[9]) == ("l1",) and index.holds("r", H[3]) == ()
    with pytest.raises(ValueError):
        log.since(-1)


def test_snapshot_is_the_state_after_its_seq():
    log = EventLog("r")
    log.publish(BlockStored("l1", (H[0], H[1])), BlockStored("l2", (H[1],)))
    log.publish(BlockRemoved("l1", (H[0],), "evicted"))
    snap = log.snapshot()
    assert snap["seq"] == 2 and snap["replica_id"] == "r"
    assert snap["tiers"] == {"l1": [H[1].hex()], "l2": [H[1].hex()], "l3": []}
    log.publish(AllCleared(None))
    assert log.snapshot()["tiers"] == {"l1": [], "l2": [], "l3": []} and log.snapshot()["seq"] == 3


# ---------------------------------------------------------------------- the engine's tiers
def test_commit_publishes_l1_stores_in_prefix_order_once():
    engine, log = _engine()
    ns = _ns()
    hashes = _store(engine, ns, _tokens(3, 1))
    assert _events(log) == [("BlockStored", "l1", None, tuple(hashes))]
    _store(engine, ns, _tokens(3, 1))  # the same blocks again: a duplicate, nothing new to announce
    assert log.seq == 1
    engine.check_integrity()


def test_an_eviction_sweep_is_one_batch_and_write_back_announces_l2():
    engine, log = _engine(l1=6, l2=16)
    ns = _ns()
    first = _store(engine, ns, _tokens(4, 1))
    seq = log.seq
    _store(engine, ns, _tokens(4, 2))  # needs 4 blocks: 2 plain free + 2 evicted from the first prompt
    evs = _events(log, seq)
    assert evs[0][:3] == ("BlockRemoved", "l1", "evicted") and set(evs[0][3]) <= set(first) and len(evs[0][3]) == 2
    assert evs[1][:3] == ("BlockStored", "l2", None) and set(evs[1][3]) == set(evs[0][3])  # written back
    assert evs[2][:2] == ("BlockStored", "l1")
    batches, _ = log.since(seq)
    assert [b.seq for b in batches] == list(range(seq + 1, seq + 1 + len(batches)))
    assert len(batches[0].events) == 1  # every block the sweep evicted is in one event of one batch
    engine.check_integrity()


def test_a_scoped_flush_announces_removals_and_a_full_flush_clears_each_tier():
    engine, log = _engine(l1=8, l2=16)
    a, b = _ns(), _ns()
    ha = _store(engine, a, _tokens(2, 1), owner="A")
    hb = _store(engine, b, _tokens(2, 2), owner="B")
    seq = log.seq
    engine.flush(lambda t: t.owner == "A")
    assert _events(log, seq) == [("BlockRemoved", "l1", "flushed", tuple(ha))]
    assert _replayed(log)["l1"] == set(hb)  # B's blocks are still announced as held
    _store(engine, b, _tokens(7, 3), owner="B")  # evicts one of B's blocks down to L2
    assert engine.l2.pool.num_cached > 0
    seq = log.seq
    engine.flush(lambda t: True)
    batches, _ = log.since(seq)
    assert [e for bt in batches for e in bt.events] == [AllCleared("l1"), AllCleared("l2")]
    assert _replayed(log) == {"l1": set(), "l2": set(), "l3": set()}


def test_a_tenant_cap_announces_capped_blocks():
    engine, log = _engine(l1=12)
    ns = _ns()
    hashes = _store(engine, ns, _tokens(4, 1))
    seq = log.seq
    engine.set_tenant_cap("t", 2 * BS)
    evs = _events(log, seq)
    assert len(evs) == 1 and evs[0][:3] == ("BlockRemoved", "l1", "capped") and set(evs[0][3]) <= set(hashes)
    assert len(evs[0][3]) == 2
    assert _replayed(log)["l1"] == {bytes(h) for h in engine.pool._index}


def test_a_corrupt_l2_block_is_announced():
    engine, log = _engine(l1=4, l2=16)
    ns = _ns()
    tokens = _tokens(3, 1)
    hashes = _store(engine, ns, tokens)
    _store(engine, ns, _tokens(3, 2))  # evicts the first prompt's blocks to L2
    items = [(h, tuple(tokens[i * BS:(i + 1) * BS])) for i, h in enumerate(hashes)]
    down = [item for item in items if engine.l2.contains(*item)]
    assert down and down[0][0] in _replayed(log)["l2"]
    engine.l2.corrupt(down[0][0])
    seq = log.seq
    engine.l2.get([down[0]])
    assert _events(log, seq) == [("BlockRemoved", "l2", "corrupt", (down[0][0],))]
    assert down[0][0] not in _replayed(log)["l2"]


def test_the_replayed_stream_equals_the_tiers_and_the_snapshot_after_a_busy_workload():
    engine, log = _engine(l1=10, l2=12)
    nss = [_ns() for _ in range(3)]
    for i in range(30):
        _store(engine, nss[i % 3], _tokens(1 + i % 5, i % 7), owner=f"t{i % 3}")
        if i == 17:
            engine.flush(lambda t: t.owner == "t1")
    engine.drain_writes()
    replay = _replayed(log)
    assert replay["l1"] == set(engine.pool._index) and replay["l2"] == set(engine.l2.pool._index)
    snap = log.snapshot()
    assert {t: {bytes.fromhex(h) for h in hs} for t, hs in snap["tiers"].items()} == replay
    engine.check_integrity()


def test_l3_chunks_are_announced_with_every_block_and_removed_by_chunk(tmp_path):
    ring = crypto.Keyring()
    ring.add("t", 1, crypto.generate_key())
    store = RemoteStore(open_backend(tmp_path.as_uri()), ring, LAYOUT, chunk_blocks=2)
    engine, log = _engine(l1=8, l3=store)
    ns = _ns()
    tokens = _tokens(5, 1)
    hashes = chain_hashes(ns, tokens, BS)
    seq = log.seq
    run = engine.admit(ns, tokens, owner="t", model="m", revision="r")  # a request computing 5 blocks
    engine.finish_loads(run)
    engine.l1.write(run.blocks[:5], _kv(5))
    engine.mark_computed(run, 5 * BS)
    engine.release(run)
    engine.drain_writes()
    stored_l3 = [h for name, tier, _, hs in _events(log, seq) if name == "BlockStored" and tier == "l3" for h in hs]
    assert stored_l3 == hashes[:4]  # two whole chunks; the fifth block is not a chunk
    assert _replayed(log)["l3"] == set(hashes[:4])
    seq = log.seq
    engine.flush(lambda t: True, l3_scope={"tenant": "t"})
    removed = [(r, hs) for name, tier, r, hs in _events(log, seq) if tier == "l3"]
    assert removed and all(r == "flushed" for r, _ in removed)
    assert {h for _, hs in removed for h in hs} == set(hashes[:4])
    assert _replayed(log)["l3"] == set()


def test_the_kv_events_benchmark_core_runs_and_sees_its_events():
    from bench.kv_events import LAYOUT as BENCH_LAYOUT
    from bench.kv_events import _trace, run_engine, run_index

    trace = _trace(40)
    nss = [Namespace.build(scope_salt=secrets.token_bytes(32), model_id="b", weight_digest="w", tokenizer_digest="t",
                           layout=BENCH_LAYOUT.canonical(), rope={"theta": 1.0}) for _ in range(4)]
    assert run_engine(trace, nss, None) > 0
    log = EventLog("b:0:x")
    run_engine(trace, nss, log)
    assert log.seq > 0 and log.counts["hashes"] > 0
    batches = [b.to_dict() for b in log.since(0, limit=10_000)[0]]
    applied, per_match = run_index(batches, 2, [chain_hashes(nss[t], tokens, BS) for t, tokens in trace])
    assert applied > 0 and per_match > 0


def test_l3_evictions_for_capacity_and_expiry_by_retention_are_announced(tmp_path):
    from cachecore.event_recorders import L3Recorder
    from cachecore.tiers.base import Tag

    ring = crypto.Keyring()
    ring.add("t", 1, crypto.generate_key())
    probe = RemoteStore(open_backend((tmp_path / "probe").as_uri()), ring, LAYOUT, chunk_blocks=2)
    store = RemoteStore(open_backend(tmp_path.as_uri()), ring, LAYOUT, chunk_blocks=2,
                        capacity_bytes=probe._frame_bytes + 10)  # room for one chunk
    log = EventLog("r")
    L3Recorder(log).attach(store)
    ns = _ns()
    tag = Tag("t", "m", "r", ns.digest)
    first, second = _tokens(2, 1), _tokens(2, 2)
    h1, h2 = chain_hashes(ns, first, BS), chain_hashes(ns, second, BS)
    assert store.put_chunk(h1, first, tag, _kv(2))
    assert store.put_chunk(h2, second, tag, _kv(2))  # evicts the first chunk for room
    evs = _events(log)
    assert evs[0] == ("BlockStored", "l3", None, tuple(h1))
    assert ("BlockRemoved", "l3", "evicted", tuple(h1)) in evs and evs[-1] == ("BlockStored", "l3", None, tuple(h2))
    seq = log.seq
    store.sweep({"t": 0.0}, None)  # a retention of zero: everything is past it
    assert _events(log, seq) == [("BlockRemoved", "l3", "expired", tuple(h2))]
    assert _replayed(log)["l3"] == set()
