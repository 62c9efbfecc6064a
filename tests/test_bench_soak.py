"""bench.soak's pure parts: the fault schedule and windows, how a request's outcome is classified, and
the invariant checks on synthetic data (the soak itself runs outside pytest: ``python -m bench.soak``)."""

from __future__ import annotations

from bench._soak import checks
from bench._soak.faults import KINDS, FaultEvent, Window, schedule, windows
from bench._soak.load import Sample


def sample(start: float, end: float, status: int | None = 200, **kw) -> Sample:
    return Sample(kw.pop("tenant", "t"), kw.pop("profile", "steady"), kw.pop("kind", "stream"), "m", start, end,
                  status, **kw)


# ---------------------------------------------------------------------- schedule and windows
def test_schedule_spreads_every_kind_between_warm_up_and_recovery_in_order():
    plan = schedule(10.0, 100.0, quick=False)
    assert [f.kind for f in plan] == list(KINDS) and plan[0].kind == "celery_kill"
    assert plan[0].at == 25.0 and plan[-1].at == 90.0  # 15% and 80% of the load, after its start
    assert all(a.at < b.at for a, b in zip(plan, plan[1:], strict=False))
    assert {f.kind: f.hold for f in plan if f.hold} == {"redis_stop": 20.0, "redis_pause": 5.0}


def test_quick_schedule_holds_faults_shorter_and_skipped_kinds_are_left_out():
    plan = schedule(0.0, 60.0, quick=True, kinds=("redis_stop", "l3_corrupt"))
    assert [(f.kind, f.hold) for f in plan] == [("redis_stop", 8.0), ("l3_corrupt", 0.0)]
    assert schedule(0.0, 60.0, quick=True, kinds=()) == []


def test_a_window_runs_from_the_fault_to_its_heal_plus_grace_or_to_the_end_if_it_never_healed():
    wins = windows([FaultEvent("redis_stop", 10.0, 18.0), FaultEvent("web_restart", 30.0, None)],
                   grace=5.0, run_end=100.0)
    assert wins == [Window("redis_stop", 10.0, 23.0), Window("web_restart", 30.0, 100.0)]
    assert wins[0].covers(5.0, 11.0) and wins[0].covers(22.0, 40.0)
    assert not wins[0].covers(1.0, 9.9) and not wins[0].covers(23.1, 25.0)


# ---------------------------------------------------------------------- outcomes
WIN = [Window("redis_stop", 10.0, 20.0), Window("web_restart", 40.0, 50.0)]


def test_outcomes_ok_retryable_throttled_and_bad():
    assert checks.classify(sample(0, 1), WIN) == "ok"
    assert checks.classify(sample(11, 12, 503, retry_after=True), WIN) == "retryable"
    assert checks.classify(sample(11, 12, 503, retry_after=False), WIN) == "bad"  # no Retry-After
    assert checks.classify(sample(11, 12, 500, retry_after=True), WIN) == "bad"
    assert checks.classify(sample(11, 12, 200, stream_error=True, stream_retryable=True, error="worker_failed"),
                           WIN) == "retryable"
    assert checks.classify(sample(11, 12, 200, stream_error=True, stream_retryable=False, error="cancelled"),
                           WIN) == "bad"


def test_request_stopped_is_accepted_only_for_the_tenant_whose_key_the_operators_shred():
    ops = sample(0, 1, 503, retry_after=True, error="request_stopped", profile="ops")
    ops_stream = sample(0, 1, 200, stream_error=True, stream_retryable=True, error="request_stopped", profile="ops")
    steady = sample(0, 1, 503, retry_after=True, error="request_stopped", profile="steady")
    client_gone = sample(0, 1, 499, error="cancelled", profile="ops")  # never an answer a waiting client gets
    assert [checks.classify(s, []) for s in (ops, ops_stream, steady, client_gone)] == [
        "stopped", "stopped", "retryable", "bad"]
    s = checks.summarize([ops, ops_stream, steady, client_gone], [])
    assert s.stopped == 2 and s.outside_ok == 2 and s.bad == [steady, client_gone]


def test_a_quota_429_is_throttling_only_for_tenants_meant_to_hit_their_quota():
    quota = sample(0, 1, 429, retry_after=True, error="rate_limited", profile="quota")
    steady = sample(0, 1, 429, retry_after=True, error="rate_limited", profile="steady")
    assert checks.classify(quota, []) == "throttled"
    assert checks.classify(steady, []) == "retryable"  # allowed inside a window, a failure outside
    s = checks.summarize([quota, steady], [])
    assert s.throttled == 1 and s.outside == 2 and s.outside_ok == 1 and s.bad == [steady]


def test_a_refused_connection_is_retryable_only_while_the_web_process_restarts():
    assert checks.classify(sample(41, 42, None, error="ConnectError"), WIN) == "retryable"
    assert checks.classify(sample(11, 12, None, error="ConnectError"), WIN) == "bad"


def test_summary_counts_outside_and_inside_windows_and_500s_anywhere():
    samples = [sample(0, 1), sample(1, 2, 503, retry_after=True), sample(12, 13, 503, retry_after=True),
               sample(14, 15), sample(30, 31, 500)]
    s = checks.summarize(samples, WIN)
    assert (s.outside, s.outside_ok, s.inside, s.inside_ok, s.retryable_inside, s.status_500) == (3, 1, 2, 1, 1, 1)
    assert len(s.bad) == 2 and s.outside_ratio == 1 / 3
    inv = checks.requests_invariant(s)
    assert not inv.ok and "500s 1" in inv.detail
    assert checks.requests_invariant(checks.summarize([sample(0, 1), sample(12, 13, 503, retry_after=True)], WIN)).ok


def test_ttft_phases_split_warm_up_steady_and_each_fault():
    samples = [sample(1, 2, ttft=0.5), sample(25, 26, ttft=0.1), sample(27, 28, ttft=0.3),
               sample(12, 13, ttft=2.0), sample(30, 31)]
    phases = checks.ttft_by_phase(samples, WIN, warmup_end=5.0)
    assert phases == {"warm-up": (1, 0.5, 0.5), "steady": (2, 0.1, 0.3), "redis_stop": (1, 2.0, 2.0)}


# ---------------------------------------------------------------------- invariants
def test_jobs_must_be_final_succeeded_and_verified_and_a_retry_is_reported():
    good = {1: {"status": "succeeded", "verified": True, "attempts": 2}}
    inv = checks.jobs_invariant(good, {1: "rollout"})
    assert inv.ok and "retried [1]" in inv.detail
    assert not checks.jobs_invariant({1: {"status": "running", "verified": False}}, {1: "flush"}).ok
    assert not checks.jobs_invariant({1: {"status": "succeeded", "verified": False}}, {1: "flush"}).ok
    assert not checks.jobs_invariant({1: {"status": "partial", "verified": True}}, {1: "flush"}).ok
    assert not checks.jobs_invariant(good, {1: "rollout", 2: "flush"}).ok  # a job asked for and never seen


def test_audit_head_must_equal_the_external_head_log():
    verify = {"ok": True, "length": 7, "head": "abc"}
    assert checks.audit_invariant(verify, {"seq": 7, "hash": "abc"}).ok
    assert not checks.audit_invariant(verify, {"seq": 7, "hash": "abd"}).ok
    assert not checks.audit_invariant(verify, {"seq": 6, "hash": "abc"}).ok
    assert not checks.audit_invariant({**verify, "ok": False}, {"seq": 7, "hash": "abc"}).ok
    assert not checks.audit_invariant(verify, None).ok


def test_l3_accounting_must_equal_the_objects_present_on_every_replica():
    agree = {"a:0": {"store_objects": 3, "store_used_bytes": 300}, "a:1": {"store_objects": 3, "store_used_bytes": 300}}
    assert checks.l3_invariant(agree, (3, 300)).ok
    assert not checks.l3_invariant({**agree, "a:1": {"store_objects": 4, "store_used_bytes": 400}}, (3, 300)).ok
    assert not checks.l3_invariant({"a:0": {"error": "RayActorError"}}, (0, 0)).ok
    assert not checks.l3_invariant({}, (0, 0)).ok


def test_pools_and_quota_counters_per_replica():
    assert checks.pools_invariant({"a:0": "ok", "a:1": "ok"}).ok
    assert not checks.pools_invariant({"a:0": "ok", "a:1": "AssertionError: in-flight blocks"}).ok
    assert checks.quotas_invariant({"a:0": {"running": 0, "waiting": 0}}).ok
    assert not checks.quotas_invariant({"a:0": {"running": 1, "waiting": 0}}).ok


def test_isolation_is_paired_owner_hits_and_nobody_else_does():
    assert checks.canary_invariant([32, 32], [0, 0, 0], [35], [0, 0]).ok
    assert not checks.canary_invariant([32], [0, 16], [35], [0]).ok  # another tenant saw the owner's cache
    assert not checks.canary_invariant([0], [0], [35], [0]).ok  # the owner's repeat missed: caching is broken
    assert not checks.canary_invariant([32], [0], [35], [35]).ok  # the KV API leaked


def test_greedy_reruns_must_be_identical():
    assert checks.greedy_invariant([("a", "a"), ("b", "b")]).ok
    assert not checks.greedy_invariant([("a", "a"), ("b", "c")]).ok
    assert not checks.greedy_invariant([]).ok


def test_operators_never_see_a_500_and_a_503_only_inside_a_window():
    wins = [Window("pg_terminate", 10.0, 20.0)]
    assert checks.operators_invariant([(1.0, "/ui/", 200), (12.0, "/ui/", 503), (13.0, "/ui/", None)],
                                      [(12.0, 503), (13.0, 200)], wins, 0).ok
    assert not checks.operators_invariant([(12.0, "/ui/", 500)], [], wins, 0).ok  # a 500, even in a window
    assert not checks.operators_invariant([], [(12.0, 500)], wins, 0).ok
    assert not checks.operators_invariant([(30.0, "/ui/", 503)], [], wins, 0).ok  # a 503 outside every window
    assert not checks.operators_invariant([], [], wins, 1).ok  # an admin write that did not apply


def test_any_429_with_retry_after_is_throttling_for_a_tenant_meant_to_hit_its_quotas():
    for code in ("rate_limit_requests", "rate_limit_tokens", "tenant_busy"):
        assert checks.classify(sample(0, 1, 429, retry_after=True, error=code, profile="quota"), []) == "throttled"
    assert checks.classify(sample(0, 1, 429, retry_after=False, error="rate_limit_requests", profile="quota"),
                           []) == "bad"  # a 429 must say when to retry
