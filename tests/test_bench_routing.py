"""bench.routing: the simulation's cache, trace preparation and replicas, and the quick run's output."""

from __future__ import annotations

import math

import pytest

from bench import routing, traces
from bench._routing_sim import SimReplica, TierCache, simulate
from bench._routing_trace import prepare
from bench.traces import TraceRequest
from cachecore.routing import CostModel, Rates, RoundRobin

RATES = Rates(prefill_tokens_per_s=10_000.0, load_tokens_per_s={"l1": math.inf, "l2": 100_000.0}, decode_step_s=0.01)


def test_tier_cache_evicts_the_tenant_over_its_share_lru_first():
    cache = TierCache(4)
    cache.put(1, tenant=0)
    cache.put(2, tenant=0)
    evicted = []
    for key in (10, 11, 12, 13):  # tenant 1 floods
        evicted += cache.put(key, tenant=1)
    assert evicted == [(10, 1), (11, 1)]  # its own oldest blocks go
    assert 1 in cache and 2 in cache  # tenant 0 keeps its share
    cache.put(3, tenant=0)  # now tenant 0 is over its share of 2
    assert 1 not in cache and 2 in cache and 3 in cache
    cache.put(2, tenant=0)  # refreshed: 3 is now tenant 0's oldest
    cache.put(4, tenant=0)
    assert 3 not in cache and 2 in cache


def _trace() -> list[TraceRequest]:
    sys = [0, 1, 2]
    return [
        TraceRequest(0, 2_000, 100, (*sys, 3)),  # session A turn 1 (last block partial)
        TraceRequest(1_000, 2_100, 100, (*sys, 4)),  # session B, same system prompt
        TraceRequest(5_000, 3_000, 100, (*sys, 3, 5)),  # session A turn 2 extends turn 1
        TraceRequest(6_000, 700, 50, (6, 7)),  # a one-off
    ]


def test_prepare_continues_a_session_only_when_the_whole_earlier_prompt_is_a_prefix():
    t = prepare(_trace(), replicas=2, prefill_tokens_per_s=10_000.0, load=0.5)
    a1, b1, a2, one = t.requests
    assert a2.session == a1.session
    assert b1.session != a1.session and one.session not in (a1.session, b1.session)
    assert t.sessions == 3
    assert a2.keys[:3] == a1.keys[:3] == b1.keys[:3]  # the shared system prompt's full blocks
    assert a1.usable == 3 and a2.usable == 5  # (2000 - 1) // 512, (3000 - 1) // 512
    assert t.offered_load == pytest.approx(0.5)
    assert t.requests[-1].arrival_s == pytest.approx(sum(r.input_length for r in _trace()) / (0.5 * 2 * 10_000.0))


def test_a_replica_hits_what_it_served_and_its_prefill_time_is_the_cost_model():
    t = prepare(_trace(), replicas=1, prefill_tokens_per_s=10_000.0)
    a1, _, a2, _ = t.requests
    replica = SimReplica("r0", RATES, l1_blocks=2, l2_blocks=8)
    assert replica.hit(a2) == {}
    replica.enqueue(a1, 0)
    assert replica.state(0.0).queued_prefill_tokens == a1.prompt_tokens
    req, end, loaded = replica.start_next(0.0, CostModel())
    assert req is a1 and end == pytest.approx(a1.prompt_tokens / 10_000.0) and loaded == 0
    replica.finish(a1)
    assert replica.hit(a2) == {"l1": 2 * 512, "l2": 3 * 512}  # 3 full blocks: 2 in L1, 1 demoted to L2
    assert replica.state(end).running == 1


def test_simulate_serves_every_request_and_counts_hits_token_weighted():
    t = prepare(_trace(), replicas=2, prefill_tokens_per_s=10_000.0)
    res = simulate(t.requests, RoundRobin(), replicas=1, rates=RATES, l1_blocks=16, l2_blocks=16)
    assert len(res.ttft_s) == 4 and all(x > 0 for x in res.ttft_s)
    assert res.loaded_tokens == 3 * 512 * 2  # B and A's turn 2 reuse the 3 system blocks (A's 4th is partial)
    assert res.hit_ratio == pytest.approx(res.loaded_tokens / sum(r.input_length for r in _trace()))
    cold = simulate(t.requests, RoundRobin(), replicas=1, rates=RATES, l1_blocks=0, l2_blocks=0)
    assert cold.loaded_tokens == 0 and cold.mean_ttft > res.mean_ttft


def test_quick_run_prints_a_table_per_configuration_and_a_result_line(capsys):
    routing.main(["--quick", "--replicas", "2"])
    out = capsys.readouterr().out
    for policy in ("round_robin", "least_loaded", "sglang", "strata"):
        assert out.count(f"  {policy} ") == 3  # one row per cache size
    assert "infinite-cache hit bound" in out and "offered load 75%" in out
    result = out.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    keys = dict(kv.split("=") for kv in result.split()[1:])
    assert set(keys) == {"strata_vs_best_mean_ttft", "strata_vs_best_p99", "hit_vs_bound_min", "hit_vs_lru_min",
                         "goal_met"}
    assert keys["goal_met"] in ("True", "False")


def test_the_fast25_shape_runs_on_the_real_trace_s_shape(capsys):
    routing.main(["--quick", "--shape", "fast25", "--requests", "300", "--replicas", "2"])
    out = capsys.readouterr().out
    assert "generated fast25 shape (300 requests" in out and "N=2: 300 requests" in out
    assert out.count("one LRU cache of their total capacity hits") == 3
    assert out.strip().splitlines()[-1].startswith("RESULT ")
    with pytest.raises(SystemExit) as exc:
        routing.main(["--requests", "300"])  # a request count is a fast25 option
    assert exc.value.code == 2
    assert "--requests needs --shape fast25" in capsys.readouterr().err


def test_the_simulated_router_sees_each_request_s_usable_block_keys():
    t = prepare(_trace(), replicas=2, prefill_tokens_per_s=10_000.0)
    seen = []

    class Spy(RoundRobin):
        def choose(self, request, replicas, hits):
            seen.append((request.blocks, request.block_tokens))
            return super().choose(request, replicas, hits)

    simulate(t.requests, Spy(), replicas=2, rates=RATES, l1_blocks=16, l2_blocks=16)
    assert seen == [(r.keys[: r.usable], 512) for r in t.requests]


def test_run_results_stay_within_the_infinite_cache_bound():
    configs = routing.run([2], rates=RATES, load=0.75, quick=True)
    assert [c.frac for c in configs] == list(routing.FRACS)
    for c in configs:
        assert [r.policy for r in c.results] == ["round_robin", "least_loaded", "sglang", "strata"]
        assert 0.0 < c.lru_hit <= c.trace.infinite_hit + 1e-9
        for r in c.results:
            assert 0.0 <= r.hit_ratio <= c.trace.infinite_hit + 1e-9
            assert r.imbalance >= 1.0
    assert configs[-1].result("strata").hit_ratio > configs[0].result("round_robin").hit_ratio


def test_a_trace_file_is_read_and_a_bad_one_is_a_clear_error(tmp_path, capsys):
    good = tmp_path / "t.jsonl"
    traces.write_trace(good, traces.generate_trace(sessions=8, one_offs=2, seed=1))
    routing.main(["--trace", str(good), "--replicas", "2"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(SystemExit) as exc:
        routing.main(["--trace", str(bad)])
    assert exc.value.code == 2
    assert "missing field" in capsys.readouterr().err
