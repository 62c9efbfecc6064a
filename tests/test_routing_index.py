"""The router's prefix index: in-order batches apply, duplicates and stale reorderings are harmless,
a gap is reported and healed by a snapshot, hits are per tier and contiguous, corrections drop what a
replica did not serve, and it is scoped by construction (tenant B never matches tenant A)."""

from __future__ import annotations

import secrets

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachecore.events import AllCleared, BlockRemoved, BlockStored, EventBatch, EventLog, InvalidEvent
from cachecore.routing.hashes import namespace_fields, request_hashes, request_salt
from cachecore.routing.index import PrefixIndex
from tests.worker_calls import complete

BS = 16
H = [bytes([i]) * 32 for i in range(64)]


def _batch(rid: str, seq: int, *events) -> EventBatch:
    return EventBatch(rid, seq, 0.0, tuple(events))


def _fed(*batches) -> PrefixIndex:
    index = PrefixIndex()
    for b in batches:
        assert index.apply(b)
    return index


# ---------------------------------------------------------------------- consistency
def test_batches_apply_in_order_and_a_duplicate_changes_nothing():
    b1 = _batch("r", 1, BlockStored("l1", (H[0], H[1])))
    b2 = _batch("r", 2, BlockRemoved("l1", (H[1],), "evicted"))
    index = _fed(b1, b2)
    assert index.holds("r", H[0]) == ("l1",) and index.holds("r", H[1]) == ()
    assert index.apply(b1) is True and index.apply(b2) is True  # delivered twice: ignored
    assert index.holds("r", H[1]) == () and index.expected_seq("r") == 3
    assert index.counts["ignored"] == 2


def test_a_reordered_older_batch_is_ignored_and_a_skipped_one_is_a_gap():
    index = _fed(_batch("r", 1, BlockStored("l1", (H[0],))), _batch("r", 2, BlockRemoved("l1", (H[0],), "evicted")))
    assert index.apply(_batch("r", 1, BlockStored("l1", (H[0],)))) is True  # late copy of batch 1
    assert index.holds("r", H[0]) == ()  # it did not resurrect the evicted block
    assert index.apply(_batch("r", 4, BlockStored("l1", (H[5],)))) is False  # batch 3 was lost
    assert index.holds("r", H[5]) == () and index.expected_seq("r") == 3  # nothing applied


def test_a_replica_first_seen_mid_stream_is_a_gap_until_reconciled():
    log = EventLog("r")
    for i in range(5):
        log.publish(BlockStored("l2", (H[i],)))
    index = PrefixIndex()
    assert index.apply(log.since(4)[0][0]) is False
    index.reconcile(log.snapshot())
    assert index.holds("r", H[3]) == ("l2",) and index.expected_seq("r") == 6
    log.publish(BlockRemoved("l2", (H[3],), "flushed"))
    assert index.apply(log.since(5)[0][0]) is True and index.holds("r", H[3]) == ()


def test_reconcile_replaces_the_replicas_state_and_leaves_others_alone():
    index = _fed(_batch("a", 1, BlockStored("l1", (H[0], H[1]))), _batch("b", 1, BlockStored("l1", (H[0],))))
    index.reconcile({"replica_id": "a", "seq": 9, "tiers": {"l1": [H[2].hex()], "l3": [H[2].hex()]}})
    assert index.holds("a", H[0]) == () and index.holds("a", H[2]) == ("l1", "l3")
    assert index.holds("b", H[0]) == ("l1",)
    assert index.apply(_batch("a", 9, BlockStored("l1", (H[7],)))) is True and index.holds("a", H[7]) == ()
    for bad in ({"replica_id": "a", "seq": -1, "tiers": {}}, {"replica_id": "a", "seq": 1, "tiers": {"l9": []}},
                {"replica_id": "a", "seq": 1, "tiers": {"l1": ["nothex"]}}, []):
        with pytest.raises(InvalidEvent):
            index.reconcile(bad)
    assert index.holds("a", H[2]) == ("l1", "l3")  # a bad snapshot changed nothing


def test_all_cleared_empties_one_tier_or_every_tier():
    index = _fed(_batch("r", 1, BlockStored("l1", (H[0], H[1])), BlockStored("l2", (H[1],))),
                 _batch("r", 2, AllCleared("l1")))
    assert index.holds("r", H[0]) == () and index.holds("r", H[1]) == ("l2",)
    assert index.apply(_batch("r", 3, AllCleared(None)))
    assert index.holds("r", H[1]) == ()


def test_memory_per_replica_is_bounded_least_recently_stored_first():
    index = PrefixIndex(max_blocks_per_replica=3)
    index.apply(_batch("r", 1, BlockStored("l1", (H[0], H[1], H[2]))))
    index.apply(_batch("r", 2, BlockStored("l1", (H[0],))))  # re-stored: the most recent now
    index.apply(_batch("r", 3, BlockStored("l1", (H[3],))))
    assert index.holds("r", H[1]) == () and index.holds("r", H[0]) == ("l1",) and index.holds("r", H[3]) == ("l1",)
    assert index.counts["forgotten_blocks"] == 1


def test_drop_replica_forgets_it():
    index = _fed(_batch("r", 1, BlockStored("l1", (H[0],))))
    index.drop_replica("r")
    assert index.match([H[0]], BS) == {} and index.expected_seq("r") == 1


# ---------------------------------------------------------------------- matching
def test_match_walks_l1_then_l2_then_l3_and_reports_cumulative_tokens():
    index = _fed(
        _batch("a", 1, BlockStored("l1", (H[0], H[1])), BlockStored("l2", (H[2],)), BlockStored("l3", (H[3], H[4]))),
        _batch("b", 1, BlockStored("l3", (H[0], H[1]))),
        _batch("c", 1, BlockStored("l1", (H[1],))),  # not a prefix: no hit
    )
    hits = index.match(H[:6], BS)
    assert hits == {"a": {"l1": 32, "l2": 48, "l3": 80}, "b": {"l1": 0, "l2": 0, "l3": 32}}
    assert "c" not in hits
    # a block in L1 after an L2 stretch is not reachable the way the engine walks the tiers
    index.apply(_batch("a", 2, BlockStored("l1", (H[5],))))
    assert index.match(H[:6], BS)["a"]["l3"] == 80


def test_correct_drops_what_the_replica_did_not_serve_but_keeps_what_it_stored_since():
    index = _fed(_batch("r", 1, BlockStored("l2", tuple(H[:6]))))
    hashes = H[:6]
    assert index.match(hashes, BS)["r"]["l2"] == 96
    # the replica served only 2 blocks; then it committed the request's blocks 2..3 into L1
    index.apply(_batch("r", 2, BlockStored("l1", (H[2], H[3]))))
    assert index.correct("r", hashes, 2 * BS) == 1  # block 4 dropped; 2, 3 re-stored; 5 (last) kept
    assert index.holds("r", H[4]) == () and index.holds("r", H[2]) == ("l1", "l2")
    assert index.holds("r", H[5]) == ("l2",)
    assert index.correct("r", hashes, 0) == 0  # a second correction has no match to rely on
    assert index.correct("x", H[10:12], 0) == 0  # never matched: nothing trusted, nothing dropped


def test_match_rejects_a_bad_block_size():
    with pytest.raises(ValueError):
        PrefixIndex().match([H[0]], 0)
    with pytest.raises(ValueError):
        PrefixIndex().correct("r", [H[0]], 0)  # no block size known yet


# ---------------------------------------------------------------------- the real worker
@pytest.fixture(scope="module")
def worker():
    from workers.cache_worker import CacheWorker

    return CacheWorker(deployment="route-llama", preset="tiny", revision={"label": "r1", "seed": 21}, l1_mb=1,
                       l2_mb=1, replica=2)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(worker, salt: bytes, prompt: list[int], tenant: str = "A", **extra) -> dict:
    out = complete(worker, {"tenant": tenant, "scope_salt": salt, "prompt": prompt, "max_tokens": 3,
                           "temperature": 0, **extra})
    assert out["type"] == "finished", out
    return out


def _index_of(worker) -> PrefixIndex:
    index = PrefixIndex()
    index.reconcile(worker.kv_snapshot())
    return index


def test_request_hashes_equal_the_workers_own_and_differ_for_another_salt(worker):
    salt, other = secrets.token_bytes(32), secrets.token_bytes(32)
    fields = worker.info()["namespace_fields"]
    assert "scope_salt" not in fields and fields["block_size"] == BS
    prompt = _prompt(70, 1)
    ns = worker.revisions.active.loaded.namespace(salt)
    from cachecore.hashing import chain_hashes

    assert request_hashes(fields, salt, prompt) == chain_hashes(ns, prompt, BS)
    assert request_hashes(fields, other, prompt) != chain_hashes(ns, prompt, BS)
    salted = request_hashes(fields, salt, prompt, request_salt("user-7"))
    assert salted == chain_hashes(ns, prompt, BS, request_salt=request_salt("user-7"))
    assert set(salted).isdisjoint(request_hashes(fields, salt, prompt))
    assert namespace_fields(ns, BS) == fields  # read from the namespace itself


def test_tenant_b_never_matches_tenant_a_blocks_for_the_same_tokens(worker):
    salt_a, salt_b = secrets.token_bytes(32), secrets.token_bytes(32)
    prompt = _prompt(80, 2)
    _serve(worker, salt_a, prompt)
    index = _index_of(worker)
    fields, rid = worker.info()["namespace_fields"], worker.info()["replica_id"]
    assert index.match(request_hashes(fields, salt_a, prompt), BS)[rid]["l1"] >= 64  # A's own: a hit
    assert index.match(request_hashes(fields, salt_b, prompt), BS) == {}  # B, same tokens: nothing
    assert index.match(request_hashes(fields, salt_a, prompt, request_salt("x")), BS) == {}  # narrower: nothing


def test_the_workers_events_keep_the_index_equal_to_its_snapshot(worker):
    salt = secrets.token_bytes(32)
    index = _index_of(worker)
    rid = worker.info()["replica_id"]
    for i in range(6):
        _serve(worker, salt, _prompt(40 + 30 * i, 10 + i))
    worker.engine.drain_writes()
    answer = worker.kv_events(index.expected_seq(rid))
    assert answer["replica_id"] == rid and not answer["gap"] and answer["batches"]
    seqs = [b["seq"] for b in answer["batches"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] == answer["seq"]
    for b in answer["batches"]:
        assert index.apply(EventBatch.from_dict(b))
    snap = {t: {bytes.fromhex(h) for h in hs} for t, hs in worker.kv_snapshot()["tiers"].items()}
    assert index.held(rid) == snap == _index_of(worker).held(rid)
    engine = worker.engine
    assert snap["l1"] == set(engine.pool._index) and snap["l2"] == set(engine.l2.pool._index)
    assert worker.kv_events(answer["seq"] + 1)["batches"] == []
    with pytest.raises(ValueError):
        worker.kv_events(0)


def test_a_restarted_replica_has_a_new_id(worker):
    from workers.cache_worker import replica_id

    rid = worker.info()["replica_id"]
    assert rid.startswith("route-llama:2:")
    assert replica_id("route-llama", 2) != rid and replica_id("route-llama", 2).startswith("route-llama:2:")


def test_router_stats_report_defaults_before_measuring_and_measured_rates_after():
    from workers.cache_worker import CacheWorker
    from workers.router_stats import DEFAULT_DECODE_STEP_S, DEFAULT_PREFILL_TOKENS_PER_S

    w = CacheWorker(deployment="rates-llama", preset="tiny", revision={"label": "r1", "seed": 22}, l1_mb=1, l2_mb=1)
    before = w.info()["router"]
    assert before["measured"] == {"prefill": False, "decode": False, "l2": False, **(
        {"l3": False} if w.engine.l3 is not None else {})}
    assert before["rates"]["prefill_tokens_per_s"] == DEFAULT_PREFILL_TOKENS_PER_S
    assert before["rates"]["decode_step_s"] == DEFAULT_DECODE_STEP_S
    assert before["queued_prefill_tokens"] == 0 and before["running"] == 0 and before["cached_tokens"] == 0
    _serve(w, secrets.token_bytes(32), _prompt(300, 5))
    after = w.stats()["router"]
    assert after["measured"]["prefill"] and after["measured"]["decode"]
    assert after["rates"]["prefill_tokens_per_s"] != DEFAULT_PREFILL_TOKENS_PER_S
    assert after["rates"]["decode_step_s"] != DEFAULT_DECODE_STEP_S and after["rates"]["decode_step_s"] > 0
    assert after["cached_tokens"] >= 288
    assert after["capacity_tokens"] >= after["cached_tokens"] and after["capacity_tokens"] == before["capacity_tokens"]
    from cachecore.routing.cost import Rates

    rates = Rates(**after["rates"])  # what the router builds from it: L1 hits are loads, never recomputes
    assert rates.load_tokens_per_s["l1"] > 1e9 and set(rates.load_tokens_per_s) >= {"l1", "l2"}
    assert w.stats()["kv_events"]["seq"] == w.events.seq > 0


def test_router_stats_count_queued_prefill_tokens_and_running_requests():
    from workers.cache_worker import CacheWorker

    w = CacheWorker(deployment="queue-llama", preset="tiny", revision={"label": "r1", "seed": 23}, l1_mb=1, l2_mb=0)
    ns = w.revisions.active.loaded.namespace(secrets.token_bytes(32))
    waiting = w.engine.admit(ns, _prompt(100, 1), owner="A", max_new_tokens=4)
    decoding = w.engine.admit(ns, _prompt(40, 2), owner="B", max_new_tokens=4)
    w.engine.mark_computed(decoding, 40)  # its prefill is done
    try:
        router = w.info()["router"]
        assert router["queued_prefill_tokens"] == 100 and router["queued_requests"] == 1
        assert router["running"] == 1
    finally:
        w.engine.abort(waiting)
        w.engine.abort(decoding)
    assert w.info()["router"]["queued_prefill_tokens"] == 0 and w.info()["router"]["running"] == 0


def test_the_actor_delegates_kv_events_and_snapshot_to_its_worker():
    from workers.actor import CacheWorkerActor

    actor = CacheWorkerActor(deployment="actor-llama", preset="tiny", revision={"label": "r1", "seed": 24},
                             l1_mb=1, l2_mb=0, replica=3)
    assert actor.info()["replica_id"].startswith("actor-llama:3:")
    assert actor.kv_events(1) == {"replica_id": actor.info()["replica_id"], "seq": 0, "gap": False, "batches": []}
    assert actor.kv_snapshot()["seq"] == 0


def _poll(index: PrefixIndex, w) -> None:
    """One round of the router's feed: events in order, a snapshot on a gap or at first contact."""
    rid = w.info()["replica_id"]
    if rid not in index.replicas():
        index.reconcile(w.kv_snapshot())
        return
    answer = w.kv_events(index.expected_seq(rid))
    ok = not answer["gap"]
    for b in answer["batches"]:
        ok = ok and index.apply(EventBatch.from_dict(b))
    if not ok:
        index.reconcile(w.kv_snapshot())


def test_two_replicas_fed_by_their_events_match_where_the_prefix_was_served(worker):
    from workers.cache_worker import CacheWorker

    other = CacheWorker(deployment="route-llama", preset="tiny", revision={"label": "r1", "seed": 21}, l1_mb=1,
                        l2_mb=1, replica=3)
    index = PrefixIndex()
    for w in (worker, other):
        _poll(index, w)
    salt = secrets.token_bytes(32)
    fields = worker.info()["namespace_fields"]
    assert other.info()["namespace_fields"] == fields  # replicas of a deployment share them
    system = _prompt(96, 40)
    _serve(other, salt, system + _prompt(10, 41))
    for w in (worker, other):
        _poll(index, w)
    hits = index.match(request_hashes(fields, salt, system + _prompt(20, 42)), BS)
    assert hits[other.info()["replica_id"]]["l1"] == 96
    assert worker.info()["replica_id"] not in hits


def test_a_stale_hit_is_rechecked_by_the_replica_and_corrected(worker):
    salt = secrets.token_bytes(32)
    prompt = _prompt(90, 50)
    _serve(worker, salt, prompt, tenant="S")
    index = PrefixIndex()
    _poll(index, worker)
    rid, fields = worker.info()["replica_id"], worker.info()["namespace_fields"]
    hashes = request_hashes(fields, salt, prompt)
    assert index.match(hashes, BS)[rid]["l1"] == 80
    worker.flush({"scope": "tenant", "tenant": "S"})  # the index has not polled the flush yet
    served = _serve(worker, salt, prompt, tenant="S")["usage"]["cached_tokens"]
    assert served == 0  # the replica re-checked: nothing of it was cached any more
    assert index.correct(rid, hashes, served) == 4  # blocks 0..3 dropped (block 4, the last, kept)
    assert index.match(hashes, BS).get(rid, {}).get("l1", 0) == 0
    _poll(index, worker)  # the flush and the re-serve's commit arrive: the truth again
    assert index.match(hashes, BS)[rid]["l1"] == 80


# ---------------------------------------------------------------------- property: any delivery order heals
_OPS = st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]), st.sampled_from(["l1", "l2", "l3"]),
                          st.lists(st.integers(0, 15), min_size=1, max_size=4)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, delivery=st.lists(st.integers(0, 40), max_size=80), capacity=st.integers(2, 8))
def test_duplicates_reordering_and_loss_never_leave_the_index_wrong_after_a_poll(ops, delivery, capacity):
    log = EventLog("p", capacity=capacity)
    for kind, tier, ids in ops:
        hs = tuple(H[i] for i in ids)
        log.publish(BlockStored(tier, hs) if kind == "stored" else
                    BlockRemoved(tier, hs, "evicted") if kind == "removed" else AllCleared(tier))
    buffered = log.since(max(0, log.seq - capacity))[0]
    index = PrefixIndex()
    index.reconcile({"replica_id": "p", "seq": 0, "tiers": {}})
    for i in delivery:  # an adversarial network: any buffered batch, any number of times, any order
        if buffered:
            index.apply(buffered[i % len(buffered)])  # False on a gap: the poll below reconciles
    answer = log.since(index.expected_seq("p") - 1)
    ok = not answer[1]
    for b in answer[0]:
        ok = ok and index.apply(b)
    if not ok:
        index.reconcile(log.snapshot())
    want = {t: {bytes.fromhex(h) for h in hs} for t, hs in log.snapshot()["tiers"].items()}
    assert index.held("p") == want
