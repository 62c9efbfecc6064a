"""cachecore.routing: the cost model (segments, min(load, recompute), queue) and each policy's rule."""

from __future__ import annotations

import math

import pytest

from cachecore.routing import (
    ROUTING_POLICIES,
    CostModel,
    ExpectedTTFT,
    LeastLoaded,
    NoReplicaError,
    Rates,
    ReplicaState,
    RoundRobin,
    RouteRequest,
    SGLangRule,
)
from cachecore.routing.cost import segments
from cachecore.routing.policies import RecentWrites, WriteAges

RATES = Rates(prefill_tokens_per_s=1_000.0, load_tokens_per_s={"l1": math.inf, "l2": 10_000.0, "l3": 500.0})


def rep(rid: str, queued: int = 0, *, running: int = 0, alive: bool = True, waiting: int = 0, cached: int = 0,
        capacity: int = 0):
    return ReplicaState(rid, RATES, queued_prefill_tokens=queued, running=running, alive=alive,
                        queued_requests=waiting, cached_tokens=cached, capacity_tokens=capacity)


# ---------------------------------------------------------------------- cost model
def test_segments_are_cumulative_by_tier_and_clipped_to_the_prompt():
    assert segments({"l1": 64, "l2": 128, "l3": 256}, 1_000) == [("l1", 64), ("l2", 64), ("l3", 128)]
    assert segments({"l1": 64, "l2": 128, "l3": 256}, 100) == [("l1", 64), ("l2", 36)]
    assert segments({"l2": 128}, 1_000) == [("l2", 128)]  # nothing in L1: all of it from L2
    assert segments({"l1": 64, "l2": 64}, 1_000) == [("l1", 64)]  # L2 reaches no further
    assert segments({}, 1_000) == []


def test_segments_reject_unknown_tiers_and_negative_lengths():
    with pytest.raises(ValueError, match="unknown tier"):
        segments({"l4": 16}, 100)
    with pytest.raises(ValueError, match="int >= 0"):
        segments({"l1": -16}, 100)


def test_queue_wait_is_queued_prefill_tokens_at_the_prefill_rate():
    cost = CostModel()
    assert cost.queue_wait_s(rep("a", 2_500)) == pytest.approx(2.5)
    assert cost.queue_wait_s(rep("a", 0)) == 0.0


def test_a_segment_is_loaded_when_loading_is_faster_and_recomputed_when_it_is_not():
    cost = CostModel()
    seconds, loaded = cost.segment_s(RATES, "l2", 1_000)  # 10k tok/s load vs 1k tok/s prefill
    assert loaded and seconds == pytest.approx(0.1)
    seconds, loaded = cost.segment_s(RATES, "l3", 1_000)  # 500 tok/s load: recompute is cheaper
    assert not loaded and seconds == pytest.approx(1.0)
    only_l2 = Rates(prefill_tokens_per_s=1_000.0, load_tokens_per_s={"l2": 10_000.0})
    assert cost.segment_s(only_l2, "l3", 1_000) == (pytest.approx(1.0), False)  # no rate: recomputed
    assert cost.segment_s(only_l2, "l1", 1_000) == (0.0, True)  # L1 left out: device pages, free


def test_expected_ttft_is_queue_plus_min_load_recompute_per_segment_plus_the_rest():
    cost = CostModel()
    hit = {"l1": 200, "l2": 400, "l3": 600}
    # queue 0.5 s; L1 200 free; L2 200 at 10k/s = 0.02; L3 200: min(0.4 load, 0.2 recompute) = 0.2; rest 400 = 0.4
    assert cost.expected_ttft_s(rep("a", 500), 1_000, hit) == pytest.approx(0.5 + 0.0 + 0.02 + 0.2 + 0.4)
    assert cost.prefill_s(RATES, 1_000, hit) == (pytest.approx(0.62), 400)  # L3 segment recomputed: not a hit
    assert cost.expected_ttft_s(rep("a", 500), 1_000, {}) == pytest.approx(1.5)  # no hit: all prefilled


def test_rates_and_states_reject_bad_values():
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Rates(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="unknown tier"):
        Rates(load_tokens_per_s={"l9": 1.0})
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        rep("a", -1)
    with pytest.raises(ValueError, match="replica_id"):
        ReplicaState("", RATES)
    assert Rates().load_tokens_per_s["l1"] == math.inf


# ---------------------------------------------------------------------- policies
REQ = RouteRequest(1_000)


def test_round_robin_cycles_over_alive_replicas_only():
    rr = RoundRobin()
    replicas = [rep("a"), rep("b", alive=False), rep("c")]
    picks = [rr.choose(REQ, replicas, {}) for _ in range(4)]
    assert picks == ["a", "c", "a", "c"]
    assert "b" not in picks


def test_least_loaded_picks_the_fewest_queued_tokens_then_fewest_running():
    ll = LeastLoaded()
    assert ll.choose(REQ, [rep("a", 300), rep("b", 100), rep("c", 200)], {}) == "b"
    assert ll.choose(REQ, [rep("a", 100, running=3), rep("b", 100, running=1)], {}) == "b"
    assert ll.choose(REQ, [rep("a", 100), rep("b", 0, alive=False)], {}) == "a"


def test_sglang_rule_follows_the_longest_hit_when_balanced():
    rule = SGLangRule()
    replicas = [rep("a", waiting=1), rep("b", waiting=2)]
    assert rule.choose(REQ, replicas, {"b": {"l1": 600}}) == "b"  # 60% > cache_threshold 0.5
    assert rule.choose(REQ, replicas, {"b": {"l1": 400}}) == "a"  # 40%: smallest tree (both empty: first)


def test_sglang_rule_below_the_cache_threshold_goes_to_the_smallest_tree():
    rule = SGLangRule()
    replicas = [rep("a"), rep("b")]
    first = rule.choose(REQ, replicas, {})
    rule.observe(REQ, first)  # that replica's tree grew by the whole prompt
    second = rule.choose(REQ, replicas, {})
    assert first == "a" and second == "b"
    assert rule.tree_tokens("a") == 1_000 and rule.tree_tokens("b") == 0


def test_sglang_rule_switches_to_the_shortest_queue_past_the_imbalance_threshold():
    rule = SGLangRule(balance_abs=4, balance_rel=1.5)
    hits = {"a": {"l1": 900}}
    assert rule.choose(REQ, [rep("a", waiting=4, running=1), rep("b", waiting=1)], hits) == "a"  # 5 - 1 = 4: balanced
    assert rule.choose(REQ, [rep("a", waiting=5, running=1), rep("b", waiting=1)], hits) == "b"  # 6 - 1 > 4, 6 > 1.5
    assert rule.choose(REQ, [rep("a", waiting=30), rep("b", waiting=25)], hits) == "a"  # 30 < 1.5 * 25: balanced


def test_expected_ttft_prefers_the_replica_holding_the_prefix():
    policy = ExpectedTTFT(CostModel())
    replicas = [rep("a", 100), rep("b", 100)]
    assert policy.choose(REQ, replicas, {"b": {"l1": 800}}) == "b"
    assert policy.choose(REQ, replicas, {"a": {"l2": 800}}) == "a"


def test_expected_ttft_leaves_the_prefix_holder_when_its_queue_makes_it_slower():
    policy = ExpectedTTFT(CostModel(), work_weight=0.0, load_guard=100.0)  # the request's own TTFT alone
    hits = {"b": {"l1": 800}}
    # b: 0.9 s queue + 0.2 s rest = 1.1 s; a: 1.0 s full prefill -> a
    assert policy.choose(REQ, [rep("a", 0), rep("b", 900)], hits) == "a"
    # b: 0.7 s queue + 0.2 s = 0.9 s < 1.0 s -> b
    assert policy.choose(REQ, [rep("a", 0), rep("b", 700)], hits) == "b"


def test_expected_ttft_keeps_a_session_on_its_replica_within_the_sticky_bound():
    policy = ExpectedTTFT(CostModel(), sticky_bonus_s=0.1)
    req = RouteRequest(1_000, session="chat-1")
    policy.observe(req, "b")
    assert policy.session_replica("chat-1") == "b"
    assert policy.choose(req, [rep("a", 0), rep("b", 50)], {}) == "b"  # 0.05 s worse: stays
    assert policy.choose(req, [rep("a", 0), rep("b", 200)], {}) == "a"  # 0.2 s worse: moves
    other = RouteRequest(1_000, session="chat-2")
    assert policy.choose(other, [rep("a", 0), rep("b", 50)], {}) == "a"  # no history: the best


def test_expected_ttft_load_guard_excludes_a_hot_replica_unless_it_is_the_least_loaded():
    hits = {"b": {"l1": 999}}
    replicas = [rep("a", 1_000), rep("b", 2_500)]  # b: 2.5 + 0.001 s; a: 1.0 + 1.0 s
    assert ExpectedTTFT(CostModel(), load_guard=1.0).choose(REQ, replicas, hits) == "a"  # b 1.5 s over a
    assert ExpectedTTFT(CostModel(), work_weight=0.0, load_guard=2.0).choose(REQ, replicas, hits) == "a"  # estimate
    cheap = [rep("a", 1_000), rep("b", 1_800)]  # b: 1.8 + 0.001 s beats a: 2.0 s
    assert ExpectedTTFT(CostModel(), load_guard=0.5).choose(REQ, cheap, hits) == "a"  # guarded out
    assert ExpectedTTFT(CostModel(), work_weight=0.0, load_guard=1.0).choose(REQ, cheap, hits) == "b"  # in the guard
    alone = [rep("b", 9_000), rep("a", 0, alive=False)]
    assert ExpectedTTFT(CostModel(), load_guard=0.0).choose(REQ, alone, hits) == "b"  # the least loaded alive


def test_the_work_weight_keeps_a_prefix_holder_that_the_request_s_own_ttft_would_leave():
    hits = {"b": {"l1": 800}}  # saves 0.8 s of b's prefill: 0.2 s left there, 1.0 s anywhere else
    weighted = ExpectedTTFT(CostModel(), work_weight=1.0, prefill_guard=None)
    alone = ExpectedTTFT(CostModel(), work_weight=0.0)
    # b: 0.9 s queue. Own TTFT: 1.1 s at b > 1.0 s at a. Weighted: 0.9 + 2 x 0.2 = 1.3 < 0 + 2 x 1.0 = 2.0
    assert alone.choose(REQ, [rep("a", 0), rep("b", 900)], hits) == "a"
    assert weighted.choose(REQ, [rep("a", 0), rep("b", 900)], hits) == "b"
    # the holder is left once its extra wait passes (1 + w) x the 0.8 s saved: 1.7 + 0.4 = 2.1 > 2.0
    assert weighted.choose(REQ, [rep("a", 0), rep("b", 1_700)], hits) == "a"
    assert weighted.choose(REQ, [rep("a", 0), rep("b", 1_500)], hits) == "b"


def test_the_default_work_weight_is_the_mean_waiting_requests_with_a_floor():
    policy = ExpectedTTFT(CostModel(), prefill_guard=None)
    # queued_requests counts the one in prefill: 4 and 2 queued -> 3 and 1 waiting -> mean 2.0
    assert policy.weight([rep("a", waiting=4), rep("b", waiting=2)]) == 2.0
    assert policy.weight([rep("a", waiting=1), rep("b")]) == 1.0  # nothing waiting: the floor
    assert policy.weight([rep("a", waiting=9, alive=False), rep("b", waiting=3)]) == 2.0  # alive ones only
    assert ExpectedTTFT(CostModel(), min_work_weight=0.0).weight([rep("a", waiting=1)]) == 0.0
    assert ExpectedTTFT(CostModel(), work_weight=3.0).weight([rep("a", waiting=9)]) == 3.0  # fixed
    hits = {"b": {"l1": 800}}
    busy = [rep("a", 0, waiting=1), rep("b", 1_500, waiting=5)]  # 4 waiting on b -> w = 2.0
    # w = 2: b 1.5 + 3 x 0.2 = 2.1 < a 3 x 1.0 = 3.0 -> b; the request's own TTFT: b 1.7 > a 1.0 -> a
    assert policy.choose(REQ, busy, hits) == "b"
    assert ExpectedTTFT(CostModel(), work_weight=0.0).choose(REQ, busy, hits) == "a"


def test_a_prefix_in_flight_to_a_replica_counts_as_its_hit_until_its_queue_has_moved_on():
    policy = ExpectedTTFT(CostModel(), work_weight=0.0)
    first = RouteRequest(1_000, blocks=("k1", "k2", "k3"), block_tokens=256)
    policy.observe(first, "b")  # dispatched to b, not yet cached anywhere: the index reports no hit
    second = RouteRequest(1_000, blocks=("k1", "k2", "k3"), block_tokens=256)
    other = RouteRequest(1_000, blocks=("x1", "x2", "x3"), block_tokens=256)
    queued = [rep("a", 0), rep("b", 300, waiting=1)]  # b: the first request still in its queue
    assert policy.hit(second, queued[1], {}) == {"l1": 768, "l2": 768, "l3": 768}
    # b: 0.3 s queue + 0.232 s (the 768 in-flight tokens are free) beats a: 1.0 s
    assert policy.choose(second, queued, {}) == "b"
    assert policy.choose(other, queued, {}) == "a"  # another prefix: b's queue only costs
    # b's queue moved on (the first request was prefilled): the index now speaks for b, in-flight is forgotten
    assert policy.choose(second, [rep("a", 0), rep("b", 300, waiting=0)], {}) == "a"
    assert policy.inflight.requests("b") == 0
    # an index hit deeper than the in-flight prefix is kept as reported
    policy.observe(first, "b")
    assert policy.hit(second, rep("b", waiting=1), {"b": {"l1": 256, "l2": 1_000}}) == {"l1": 256, "l2": 1_000}


def test_ties_go_to_the_replica_sent_the_fewest_uncached_tokens():
    policy = ExpectedTTFT(CostModel())
    full = [rep("a", cached=5_000), rep("b", cached=5_000), rep("c", cached=5_000)]  # idle, caches full
    chosen = []
    for _ in range(3):
        rid = policy.choose(REQ, full, {})
        policy.observe(REQ, rid)
        chosen.append(rid)
    assert chosen == ["a", "b", "c"]  # caching the least would have sent all three to "a"
    assert policy.uncached_tokens("a") == 1_000
    hit = {"c": {"l1": 600}}
    assert policy.choose(REQ, full, hit) == "c"  # a hit decides before the tie-break
    policy.observe(REQ, "c")
    assert policy.uncached_tokens("c") == 1_000 + 400  # what it had to cache: the prompt less its hit


def test_the_prefill_guard_bounds_the_queue_a_hit_can_buy_by_the_request_s_own_prefill_time():
    hits = {"b": {"l1": 999}}  # b holds almost all of the 1.0 s prefill
    guarded = ExpectedTTFT(CostModel(), prefill_guard=1.0)
    assert guarded.choose(REQ, [rep("a", 0), rep("b", 900)], hits) == "b"  # 0.9 s over a: within 1 x 1.0 s
    assert guarded.choose(REQ, [rep("a", 0), rep("b", 1_100)], hits) == "a"  # 1.1 s over a: out
    assert ExpectedTTFT(CostModel(), prefill_guard=None).choose(REQ, [rep("a", 0), rep("b", 1_100)], hits) == "b"
    assert ExpectedTTFT(CostModel(), prefill_guard=2.0).choose(REQ, [rep("a", 0), rep("b", 1_100)], hits) == "b"
    long = RouteRequest(3_000)  # its own prefill is 3.0 s: the same queue is within its guard
    assert guarded.choose(long, [rep("a", 0), rep("b", 1_100)], {"b": {"l1": 2_999}}) == "b"
    alone = [rep("b", 9_000), rep("a", 0, alive=False)]
    assert ExpectedTTFT(CostModel(), prefill_guard=0.0).choose(REQ, alone, hits) == "b"  # the least waiting alive


def test_a_hit_counts_only_as_far_as_it_survives_the_queue_s_writes():
    policy = ExpectedTTFT(CostModel())
    hit = {"b": {"l1": 300, "l2": 800}}
    assert policy.hit(REQ, rep("b", 400), hit) == {"l1": 300, "l2": 800}  # no capacity reported: as the index says
    assert policy.hit(REQ, rep("b", 400, capacity=2_000), hit) == {"l1": 300, "l2": 800}  # 1,600 left: all of it
    assert policy.hit(REQ, rep("b", 1_500, capacity=2_000), hit) == {"l1": 300, "l2": 500}  # 500 left
    assert policy.hit(REQ, rep("b", 2_500, capacity=2_000), hit) == {"l1": 0, "l2": 0}  # the queue writes it all
    # the clipped hit is what the cost sees: b's prefix no longer pays for its queue
    assert policy.choose(REQ, [rep("a", 0, capacity=2_000), rep("b", 900, capacity=2_000)], hit) == "b"
    assert policy.choose(REQ, [rep("a", 0, capacity=1_000), rep("b", 900, capacity=1_000)], hit) == "a"


def test_a_long_prompt_may_also_wait_what_its_hit_saves():
    long = RouteRequest(3_000)  # its own prefill is 3.0 s, past long_prefill_s (1.2 s)
    hits = {"b": {"l1": 2_000}}  # saves 2.0 s on b
    queues = [rep("a", 0), rep("b", 4_500)]  # b waits 4.5 s more: over 1 x 3.0 s, within 3.0 + 2.0
    policy = ExpectedTTFT(CostModel(), work_weight=0.0)
    assert policy.guard_allowance_s(3.0, 1.0) == pytest.approx(5.0)
    assert policy.choose(long, queues, hits) == "a"  # the cost: 4.5 + 1.0 on b > 3.0 on a
    heavy = ExpectedTTFT(CostModel(), work_weight=2.0)  # the guard lets the weighted cost decide
    assert heavy.choose(long, queues, hits) == "b"  # 4.5 + 3 x 1.0 < 3 x 3.0
    assert ExpectedTTFT(CostModel(), work_weight=2.0, long_prefill_s=None).choose(long, queues, hits) == "a"
    assert ExpectedTTFT(CostModel(), work_weight=2.0, long_prefill_s=3.0).choose(long, queues, hits) == "a"
    assert heavy.choose(long, [rep("a", 0), rep("b", 5_100)], hits) == "a"  # 5.1 s over: out
    assert heavy.guard_allowance_s(1.0, 0.0) == pytest.approx(1.0)  # a short prompt: its own prefill only
    assert heavy.choose(long, [rep("a", 0), rep("b", 3_500)], {}) == "a"  # no hit, nothing saved: 3.5 s > 3.0


def test_write_ages_value_what_a_write_evicts_by_how_young_it_is():
    ages = WriteAges()
    ages.add(10, 600, 1_000)
    ages.add(20, 300, 1_000)
    assert ages.evicted_value(100, 1_000, 30, 100) == 0.0  # 900 + 100 fit
    assert ages.evicted_value(400, 1_000, 30, 100) == pytest.approx(300 * 0.8)  # 300 of the write at 10, age 20
    assert ages.evicted_value(800, 1_000, 30, 100) == pytest.approx(600 * 0.8 + 100 * 0.9)
    ages.add(30, 800, 1_000)  # the newest 300 + 800 reach the capacity: the write at 10 is forgotten
    ages.add(40, 0, 1_000)  # nothing written: no entry
    assert ages.evicted_value(0, 1_000, 130, 100) == 0.0  # 100 of the write at 20: older than the horizon
    assert ages.evicted_value(200, 1_000, 70, 100) == pytest.approx(300 * 0.5)


def test_a_large_write_goes_where_it_evicts_the_oldest_cache():
    reps = [rep("b", capacity=4_000), rep("a", capacity=4_000)]

    def routed(**params) -> ExpectedTTFT:
        policy = ExpectedTTFT(CostModel(), prefill_guard=None, **params)
        policy.choose(REQ, reps, {})  # learns the capacities
        for tokens, rid in ((2_000, "a"), (2_000, "b"), (500, "a"), (500, "b"), (500, "a"), (500, "b")):
            policy.observe(RouteRequest(tokens), rid)  # the clock: 2,000, 4,000, 4,500 .. 6,000
        return policy

    policy = routed()
    giant = RouteRequest(3_000)  # 3/4 of a capacity that holds 4 prompts of the mean size (1,000)
    assert policy.choose(giant, reps, {}) == "a"
    assert policy.eviction_s(giant, "a", 1_000.0, 8_000) == pytest.approx(1.0)  # 2,000 written at 2,000: age 4,000
    assert policy.eviction_s(giant, "b", 1_000.0, 8_000) == pytest.approx(1.5)  # 2,000 written at 4,000: younger
    assert routed(eviction_weight=0.0).choose(giant, reps, {}) == "b"  # the tie-break: equal uncached, list order
    small = RouteRequest(900)  # under LARGE_WRITE_SHARE of the capacity: no term
    assert policy.eviction_s(small, "a", 1_000.0, 8_000) == 0.0
    assert policy.choose(small, reps, {}) == "b"
    policy.observe(RouteRequest(14_000), "b")  # the mean prompt is now 3,000: the caches hold under 4 of them
    assert policy.eviction_s(giant, "a", 1_000.0, 8_000) == 0.0


def test_recent_writes_remember_the_newest_writes_up_to_the_capacity():
    writes = RecentWrites()
    assert writes.others_share("t1") == 0.0  # nothing written
    writes.add("t1", 600, 1_000)
    writes.add("t2", 300, 1_000)
    assert writes.others_share("t1") == pytest.approx(1 / 3)
    assert writes.others_share("t3") == 1.0
    writes.add("t2", 800, 1_000)  # the newest 800 + 300 reach the capacity: t1's 600 are forgotten
    assert writes.others_share("t1") == 1.0 and writes.others_share("t2") == 0.0
    writes.add("t1", 5_000, 1_000)  # one write past the capacity is remembered alone
    assert writes.others_share("t1") == 0.0


def test_whole_hits_never_grow_the_recent_writes():
    """A fully cached prompt writes nothing; remembered, such writes never left the deque (any tenant
    could grow the router's memory by resending a cached prompt)."""
    writes = RecentWrites()
    writes.add("t1", 1_000, 1_000)
    for _ in range(10_000):
        writes.add("t2", 0, 1_000)
    assert len(writes) == 1 and writes.others_share("t1") == 0.0


def test_on_small_caches_a_tenant_goes_where_its_own_blocks_are_not_squeezed_by_others():
    policy = ExpectedTTFT(CostModel(), prefill_guard=None)
    small = [rep("a", capacity=3_000), rep("b", capacity=3_000)]  # 3 prompts of 1,000: scarce
    policy.observe(RouteRequest(1_000, tenant="t1"), "a")
    policy.observe(RouteRequest(1_000, tenant="t2"), "b")
    policy.choose(REQ, small, {})  # learns the capacities
    t2 = RouteRequest(1_000, tenant="t2")
    assert policy.mixing_s(t2, "a", RATES.prefill_tokens_per_s) == pytest.approx(1.0)  # all of a's writes: t1
    assert policy.mixing_s(t2, "b", RATES.prefill_tokens_per_s) == 0.0
    assert policy.choose(t2, small, {}) == "b"  # a tie on queues and hits otherwise
    assert policy.choose(RouteRequest(1_000, tenant="t1"), small, {}) == "a"
    assert policy.choose(RouteRequest(1_000, tenant="t2"), [rep("a", capacity=3_000), rep("b", 300, capacity=3_000)],
                         {}) == "b"  # 0.3 s more queue < 1.0 s x (1 + w) of mixing on a
    big = [rep("a", capacity=4_000), rep("b", capacity=4_000)]  # 4 prompts: shares keep whole prefixes
    assert policy.choose(t2, big, {}) == "a"  # no term: the tie goes to the fewest uncached tokens, then order
    assert policy.choose(RouteRequest(1_000), small, {}) == "a"  # no tenant: no term
    off = ExpectedTTFT(CostModel(), tenant_weight=0.0)
    off.observe(RouteRequest(1_000, tenant="t1"), "a")
    off.choose(REQ, small, {})
    assert off.choose(t2, small, {}) == "b"  # the tie-break: b was sent fewer uncached tokens


def test_sticky_session_is_not_kept_on_a_guarded_out_replica():
    policy = ExpectedTTFT(CostModel(), sticky_bonus_s=10.0, load_guard=0.5)
    req = RouteRequest(1_000, session="s")
    policy.observe(req, "b")
    assert policy.choose(req, [rep("a", 0), rep("b", 400)], {}) == "b"
    assert policy.choose(req, [rep("a", 0), rep("b", 600)], {}) == "a"


@pytest.mark.parametrize("name", sorted(ROUTING_POLICIES))
def test_dead_replicas_are_never_chosen(name):
    policy = ROUTING_POLICIES[name]()
    replicas = [rep("dead", 0, alive=False, cached=0), rep("live", 5_000, waiting=50, cached=10_000)]
    hits = {"dead": {"l1": 999}}
    for _ in range(3):
        chosen = policy.choose(REQ, replicas, hits)
        policy.observe(REQ, chosen)
        assert chosen == "live"
    with pytest.raises(NoReplicaError):
        policy.choose(REQ, [rep("x", alive=False)], {})


def test_policy_parameters_are_validated():
    with pytest.raises(ValueError):
        SGLangRule(cache_threshold=1.5)
    with pytest.raises(ValueError):
        ExpectedTTFT(sticky_bonus_s=-1)
    with pytest.raises(ValueError):
        RouteRequest(-1)
    with pytest.raises(ValueError):
        RouteRequest(1_000, blocks=("k1",))  # block keys need their block size
    with pytest.raises(ValueError):
        RouteRequest(1_000, blocks=["k1"], block_tokens=16)  # a tuple: the request is frozen
    with pytest.raises(ValueError):
        ExpectedTTFT(work_weight=-0.5)
    with pytest.raises(ValueError):
        ExpectedTTFT(min_work_weight=-1)
    with pytest.raises(ValueError):
        ExpectedTTFT(eviction_weight=-1)
    with pytest.raises(ValueError):
        ExpectedTTFT(long_prefill_s=-0.5)
