"""Scheduler behaviours, step by step (no loop thread): preemption and exact recompute, fairness
between tenants, cache-aware grouping vs first-come-first-served, aging, cancellation, failures."""

from __future__ import annotations

import secrets

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.errors import OutOfBlocks
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams
from cachecore.scheduler import Failed, Finished, Request, Scheduler, State, TokenOut
from tests.test_scheduler_property import FakeRunner, alone

BS = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("sched-llama", "tiny", RevisionSpec(label="r1", seed=7), device="cpu")


@pytest.fixture
def ns(loaded):
    return loaded.namespace(secrets.token_bytes(32))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _req(runner, ns, owner, prompt, max_tokens, chunk=16, params=None) -> Request:
    return Request(owner=owner, runner=runner, ns=ns, prompt=prompt, max_tokens=max_tokens,
                   admit_kwargs={"model": "sched-llama", "revision": "r1"}, chunk=chunk, params=params)


def _events(req: Request) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get())
    return out


def _tokens(req: Request) -> list[int]:
    return [e.token_id for e in _events(req) if isinstance(e, TokenOut)]


def _run(sched: Scheduler, reqs: list[Request], limit: int = 2000) -> None:
    for _ in range(limit):
        if all(r.done.is_set() for r in reqs):
            return
        sched.step()
        sched.engine.check_integrity()
    raise AssertionError("requests never finished")


def test_preempted_request_is_recomputed_from_the_cache_with_identical_greedy_tokens(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=10, device="cpu")
    for owner in ("x", "y", "z"):
        engine.set_inflight_limit(owner, 10 * BS)
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="sched-llama", revision="r1")
    sched = Scheduler(engine, token_budget=64, max_batch=4, age_steps=2, start_thread=False)
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    p_old, p_young = _prompt(60, 1), _prompt(30, 2)
    solo = CacheEngine(loaded.layout, num_blocks=64, device="cpu")
    solo_gen = CompletionRunner(loaded.model, solo, loaded.tokenizer, model_name="sched-llama", revision="r1")
    expected = [solo_gen.complete(ns, p, owner="s", params=params, use_cache=False).token_ids
                for p in (p_old, p_young)]
    other = engine.admit(ns, _prompt(80, 3), owner="z")  # someone else holds half the pool for now
    old = sched.submit(_req(gen, ns, "x", p_old, 40, params=params))  # needs 7 blocks: waits unadmitted
    young = sched.submit(_req(gen, ns, "y", p_young, 40, params=params))  # 5 blocks: admitted at once
    assert old.seq is None and young.seq is not None
    for _ in range(5):
        sched.step()
    assert young.state is State.RUNNING and young.produced > 0
    engine.release(other)  # 5 free blocks: the older request still needs the younger one's
    _run(sched, [old, young])
    assert young.preemptions == 1 and sched.counters["preemptions"] == 1
    assert old.preemptions == 0 and old.started_step < young.started_step  # it ran while the young one waited
    assert _tokens(old) == expected[0]
    assert _tokens(young) == expected[1]  # recomputed (mostly from the cache) to the same tokens
    assert engine.pool.num_in_use == 0
    # One request, one query in the metrics, however often it was admitted (young: twice).
    for owner, prompt in (("x", p_old), ("y", p_young)):
        usage = engine.metrics.usage(owner, "sched-llama")
        assert (usage.requests, usage.query_tokens) == (1, len(prompt)), owner


def test_a_request_larger_than_the_pool_is_refused_and_holds_nothing(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=4, device="cpu")
    sched = Scheduler(engine, start_thread=False)
    with pytest.raises(OutOfBlocks, match="pool holds 4"):
        sched.submit(_req(FakeRunner(), ns, "a", list(range(60)), 10))
    fits = sched.submit(_req(FakeRunner(), ns, "a", list(range(40)), 10))
    _run(sched, [fits])
    assert isinstance(_events(fits)[-1], Finished)
    assert engine.pool.num_in_use == 0


def test_a_light_tenant_starts_within_a_chunk_of_a_bursting_tenants_queue(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=200, device="cpu")
    sched = Scheduler(engine, token_budget=20, max_batch=16, start_thread=False)
    runner = FakeRunner()
    burst = [sched.submit(_req(runner, ns, "heavy", [i % 11] + [1] * 95, 4)) for i in range(8)]
    sched.step()
    light = sched.submit(_req(runner, ns, "light", [3] * 40, 4))
    sched.step()
    sched.step()
    assert light.state is State.RUNNING  # it did not wait for the 8 x 6 chunks queued before it
    assert light.started_step == 1  # in the first step after it arrived
    assert sum(1 for r in burst if r.state is State.RUNNING) < len(burst)
    _run(sched, [*burst, light])
    assert all(r.done.is_set() for r in burst)


def test_cache_aware_ordering_groups_a_shared_prefix_and_hits_more_than_fcfs(loaded, ns):
    hits = {}
    for policy in ("cache_aware", "fcfs"):
        engine = CacheEngine(loaded.layout, num_blocks=200, device="cpu")
        sched = Scheduler(engine, token_budget=200, max_batch=8, policy=policy, start_thread=False)
        runner = FakeRunner()
        system = [(5 * i) % 11 for i in range(64)]
        reqs = [sched.submit(_req(runner, ns, "a", system + [i, i + 1, 2], 3, chunk=32)) for i in range(5)]
        _run(sched, reqs)
        hits[policy] = sum(r.cached_tokens for r in reqs)
        assert [_tokens(r) for r in reqs] == [alone(r.prompt, 3) for r in reqs]
        if policy == "cache_aware":
            assert sched.counters["deferred"] > 0
    assert hits["cache_aware"] == 4 * 64  # every follower hit the whole system prompt
    assert hits["fcfs"] < hits["cache_aware"]


def test_a_request_whose_prefix_is_being_computed_is_admitted_later_and_counted_once(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=200, device="cpu")
    sched = Scheduler(engine, token_budget=40, max_batch=8, start_thread=False)
    runner = FakeRunner()
    system = [(7 * i) % 11 for i in range(96)]
    leader = sched.submit(_req(runner, ns, "a", system + [1, 2], 2, chunk=32))
    sched.step()  # the leader computed its first chunk; the rest of the system prompt is in flight
    follower = sched.submit(_req(runner, ns, "a", system + [3, 4], 2, chunk=32))
    assert follower.seq is None  # not admitted while its prefix is being computed
    solo = sched.submit(_req(runner, ns, "a", [5] * 40, 2))
    assert solo.seq is not None  # an unrelated prompt is admitted (and prefetches) at once
    _run(sched, [leader, follower, solo])
    assert follower.cached_tokens == 96 and leader.cached_tokens == 0
    usage = engine.metrics.usage("a", "sched-llama")
    assert usage.query_tokens == 3 * 98 - 58  # each request counted once (solo's prompt is 40 tokens)
    assert usage.effective_hit_tokens == 96


def test_aging_bounds_the_wait_of_a_request_that_never_has_the_longest_hit(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=400, device="cpu")
    sched = Scheduler(engine, token_budget=40, max_batch=1, age_steps=5, start_thread=False)
    runner = FakeRunner()
    system = [(3 * i) % 11 for i in range(48)]
    warm = sched.submit(_req(runner, ns, "a", system + [1], 0))
    _run(sched, [warm])
    cold = sched.submit(_req(runner, ns, "a", [7] * 30, 2))
    hot = [sched.submit(_req(runner, ns, "a", system + [i % 11, 2], 2)) for i in range(12)]
    _run(sched, [cold, *hot])
    later = sum(1 for r in hot if r.started_step > cold.started_step)
    assert cold.waited_steps <= 5 + 1  # overdue after 5 steps, then it goes first
    assert later > 0  # longer hits went first until it aged


def test_cancel_frees_blocks_at_the_next_step_and_others_keep_running(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=64, device="cpu")
    sched = Scheduler(engine, start_thread=False)
    runner = FakeRunner()
    a = sched.submit(_req(runner, ns, "a", [1] * 20, 30))
    b = sched.submit(_req(runner, ns, "b", [2] * 20, 30))
    sched.step()
    sched.cancel(a, wait=False)
    sched.step()
    assert a.done.is_set() and a.state is State.DONE and engine.inflight_blocks("a") == 0
    assert _events(a)[-1].finish_reason == "aborted"
    assert b.state is State.RUNNING and engine.inflight_blocks("b") > 0
    _run(sched, [b])
    assert engine.pool.num_in_use == 0


def test_a_failing_forward_fails_its_requests_with_the_error_and_frees_their_blocks(loaded, ns):
    engine = CacheEngine(loaded.layout, num_blocks=64, device="cpu")
    sched = Scheduler(engine, start_thread=False)

    class Broken(FakeRunner):
        def forward_items(self, items):
            raise RuntimeError("device lost")

    bad = sched.submit(_req(Broken(), ns, "a", [1] * 20, 3))
    good = sched.submit(_req(FakeRunner(), ns, "b", [2] * 20, 3))
    _run(sched, [bad, good])
    (failed,) = _events(bad)
    assert isinstance(failed, Failed) and "device lost" in str(failed.error)
    assert _tokens(good) == alone([2] * 20, 3)
    assert engine.pool.num_in_use == 0


def test_settings_are_validated(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=8, device="cpu")
    with pytest.raises(ValueError, match="exceed"):
        Scheduler(engine, token_budget=8, max_batch=8)
    with pytest.raises(ValueError):
        Scheduler(engine, policy="random")
    with pytest.raises(ValueError):
        Scheduler(engine, max_batch=0)
    with pytest.raises(ValueError):
        Scheduler(engine).set_weight("a", -1)
    with pytest.raises(ValueError, match="contended_budget"):
        Scheduler(engine, max_batch=8, contended_budget=8)  # would leave no room beside the decodes
    with pytest.raises(ValueError, match="lean_budget"):
        Scheduler(engine, lean_budget=-1)
    assert Scheduler(engine, lean_budget=0).lean_budget == 0  # 0: a victim's first-token step is its own
    assert Scheduler(engine, token_budget=9, max_batch=8).max_batch == 8
    assert Scheduler(engine, contended_budget=0).contended_budget == 0  # 0: steps never bounded
