"""The replica directory and failover at the gateway, with stand-in actors (no Ray): a dead replica
leaves routing at once, an un-streamed request is retried on another replica, a streamed one ends
with a retryable error, the dead one is revived and put back; drains wait for running requests up to
their deadline; scaling starts the missing replicas and drains the extra ones; placement options;
jobs and stats address every replica."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ray import exceptions as rex

from controlplane.common.errors import Unavailable
from controlplane.runtime import gateway
from controlplane.runtime.replicas import ReplicaSet
from workers import actor as worker_actor


class _Method:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def remote(self, *args, **kwargs):
        self.calls.append(args)
        return self.fn(*args)


async def _value(v):
    return v


async def _raise(exc):
    raise exc


class FakeHandle:
    """A replica: ``collect``/``stream`` answer (or die), ``ping``/``info`` answer a blocking get."""

    def __init__(self, name: str, *, dies: bool = False, dies_after: int | None = None, running: int = 0) -> None:
        self.name, self.running = name, running
        self.collect = _Method(lambda req: _raise(rex.ActorDiedError()) if dies else
                               _value([{"type": "prefilled", "cached_tokens": 0}, {"type": "finished", "by": name}]))
        self.stream = _Method(lambda req: self._events(dies, dies_after))
        self.cancel = _Method(lambda rid: None)
        self.ping = _Method(lambda: True)
        self.info = _Method(lambda: {"running": self.running})

    async def _events(self, dies: bool, dies_after: int | None):
        if dies:
            raise rex.ActorDiedError()
        for i in range(3):
            if dies_after is not None and i == dies_after:
                raise rex.ActorDiedError()
            yield _value({"type": "token", "i": i, "by": self.name})
        yield _value({"type": "finished", "by": self.name})


class FakeRay:
    def __init__(self) -> None:
        self.killed = []

    def get(self, value, timeout=None):
        return value

    def kill(self, handle, no_restart=True):
        self.killed.append(handle.name)


class FakeActors:
    """``workers.actor`` stand-in: named actors by replica index; ``launch`` starts a healthy one."""

    def __init__(self) -> None:
        self.alive: dict[int, FakeHandle] = {}
        self.launched: list[int] = []
        self.revisions: list[str] = []

    actor_name = staticmethod(worker_actor.actor_name)

    def find(self, deployment, replica=0):
        return self.alive.get(replica)

    def launch(self, deployment, preset, revision, *, replica=0, **options):
        self.launched.append(replica)
        self.options = options  # engine, tensor_parallel_size
        self.revisions.append(revision["label"])
        self.alive[replica] = FakeHandle(f"r{replica}-new")
        return self.alive[replica]


@pytest.fixture
def fleet(monkeypatch):
    """A two-replica deployment in the gateway's directory, with fake actors and a fake Ray."""
    spec = gateway.WorkerSpec(deployment="fake-fleet", preset="tiny", revision={"label": "r1", "seed": 1}, replicas=2)
    rs = gateway.replica_set(spec)
    rs._actor, rs._join = FakeActors(), FakeRay
    ray = FakeRay()
    rs._join = lambda: ray
    monkeypatch.setattr("controlplane.runtime.replicas.REVIVE_BACKOFF_S", (2.0,))  # not within a test's asserts
    yield spec, rs, ray
    gateway.forget(spec.deployment)


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_dead_replica_leaves_routing_and_the_request_is_served_by_another(fleet):
    spec, rs, _ = fleet
    dead, live = FakeHandle("r0", dies=True), FakeHandle("r1")
    rs.install(0, dead)
    rs.install(1, live)
    served = [asyncio.run(gateway.acall(spec, "collect", {"request_id": f"q{i}", "prompt": [1, 2, 3]}))[-1]["by"]
              for i in range(4)]
    assert served == ["r1"] * 4  # every request succeeded, none on the dead replica
    assert len(dead.collect.calls) == 1  # tried once, then out of routing
    assert rs.replica(0).failures == 1 and rs.replica(0).dead
    assert rs.describe(0) == {"state": "dead", "inflight": 0, "failures": 1, "revivals": 0}
    assert rs.describe(1) == {"state": "ready", "inflight": 0, "failures": 0, "revivals": 0}


def test_a_dead_replica_is_revived_and_put_back(fleet, monkeypatch):
    spec, rs, _ = fleet
    monkeypatch.setattr("controlplane.runtime.replicas.REVIVE_BACKOFF_S", (0.05, 0.05))
    rs.install(0, FakeHandle("r0", dies=True))
    rs.install(1, FakeHandle("r1"))
    rs.mark_dead(rs.replica(0), revive=True)
    assert [r.index for r in rs.routable()] == [1]
    _wait_for(lambda: not rs.replica(0).dead)
    assert rs._actor.launched == [0] and rs.replica(0).revivals == 1
    assert [r.index for r in rs.routable()] == [0, 1]
    assert rs.cached(0).name == "r0-new"


def test_a_replica_found_dead_by_a_stats_call_is_revived_by_the_next_serving_call(fleet, monkeypatch):
    """A caller that may not launch replicas (stats, the console, jobs) takes a dead replica out of
    routing without reviving it; the next serving request starts its revival, so it comes back."""
    spec, rs, ray = fleet
    monkeypatch.setattr("controlplane.runtime.replicas.REVIVE_BACKOFF_S", (0.05, 0.05))
    monkeypatch.setattr(gateway, "_ray", lambda: ray)
    dead = FakeHandle("r0", dies=True)
    dead.info = _Method(lambda: (_ for _ in ()).throw(rex.ActorDiedError()))
    rs.install(0, dead)
    rs.install(1, FakeHandle("r1"))
    with pytest.raises(Unavailable):
        gateway.call(spec, "info", create=False, replica=0)
    assert rs.replica(0).dead and not rs.replica(0).reviving  # out of routing, nobody reviving it
    served = asyncio.run(gateway.acall(spec, "collect", {"request_id": "q", "prompt": [1, 2, 3]}))
    assert served[-1]["by"] == "r1"  # this request is served by the live replica, at once
    _wait_for(lambda: not rs.replica(0).dead)
    assert rs._actor.launched == [0] and rs.replica(0).revivals == 1
    assert [r.index for r in rs.routable()] == [0, 1]


def test_a_replica_revived_after_a_rollout_comes_back_on_the_registrys_revision(fleet, monkeypatch):
    spec, rs, _ = fleet
    monkeypatch.setattr("controlplane.runtime.replicas.REVIVE_BACKOFF_S", (0.05, 0.05))
    rolled = gateway.WorkerSpec(deployment=spec.deployment, preset="tiny", revision={"label": "r2", "seed": 2},
                                replicas=2)
    rs._refresh = lambda: rolled  # the registry switched to r2; no request brought the new spec here
    rs.install(1, FakeHandle("r1"))
    rs.mark_dead(rs.replica(0), revive=True)
    _wait_for(lambda: not rs.replica(0).dead)
    assert rs._actor.revisions == ["r2"] and rs.spec.revision["label"] == "r2"


def test_with_every_replica_dead_the_request_is_503(fleet):
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0", dies=True))
    rs.install(1, FakeHandle("r1", dies=True))
    with pytest.raises(Unavailable) as info:
        asyncio.run(gateway.acall(spec, "collect", {"request_id": "q", "prompt": [1]}))
    assert info.value.status == 503 and rs.routable() == []
    assert rs.replica(0).dead and rs.replica(1).dead


def _drain(spec, req):
    async def run():
        return [ev async for ev in gateway.astream(spec, req)]

    return asyncio.run(run())


def test_a_stream_that_fails_before_its_first_event_moves_to_another_replica(fleet):
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0", dies=True))
    rs.install(1, FakeHandle("r1"))
    for i in range(3):
        events = _drain(spec, {"request_id": f"s{i}", "prompt": [1, 2]})
        assert [e["type"] for e in events] == ["token", "token", "token", "finished"]
        assert {e["by"] for e in events} == {"r1"}


def test_a_stream_that_broke_after_streaming_ends_with_a_retryable_error(fleet):
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0", dies_after=1))
    rs.install(1, FakeHandle("r1", dies_after=1))
    events = _drain(spec, {"request_id": "s", "prompt": [1, 2]})
    assert [e["type"] for e in events] == ["token", "error"]
    assert events[-1]["retryable"] is True and events[-1]["code"] == "worker_failed"
    assert len(rs.routable()) == 1  # the replica that broke left routing; the other did not


def test_closing_a_stream_after_its_error_event_releases_the_replica_at_once(fleet):
    """The view closes the stream after an error event, then writes ``[DONE]``: the replica's
    in-flight count must be released by that close, not later when the inner generator is collected
    (a client reading ``[DONE]`` then finding its tenant still busy)."""
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0", dies_after=1))
    rs.install(1, FakeHandle("r1", dies_after=1))

    async def run():
        stream = gateway.astream(spec, {"request_id": "s", "prompt": [1, 2]})
        kept = []
        async for ev in stream:
            kept.append(ev)  # keeps the generator referenced, as the view's body does
            if ev["type"] == "error":
                break
        await stream.aclose()
        return kept, [(r.inflight, set(r.requests)) for r in (rs.replica(0), rs.replica(1))]

    events, counts = asyncio.run(run())
    assert events[-1]["type"] == "error"
    assert counts == [(0, set()), (0, set())]


def test_a_stream_refused_at_its_first_event_releases_the_replica_before_the_error_answers(fleet):
    """The worker refuses a streamed request with an error event (e.g. the tenant is busy): the view
    answers the error, and the replica's in-flight count is already released then, not when the
    abandoned stream is collected (the raised error's traceback still references it here)."""
    from types import SimpleNamespace

    from controlplane.serving import views

    spec, rs, _ = fleet

    async def refused():
        yield _value({"type": "error", "code": "tenant_busy", "message": "busy", "retryable": True})

    for i in (0, 1):
        handle = FakeHandle(f"r{i}")
        handle.stream = _Method(lambda req: refused())
        rs.install(i, handle)
    prep = SimpleNamespace(spec=spec, worker_req={"request_id": "s", "prompt": [1, 2]})

    async def run():
        with pytest.raises(Exception) as raised:
            await views._stream(None, prep, "text", False)
        return raised, [(r.inflight, set(r.requests)) for r in (rs.replica(0), rs.replica(1))]

    raised, counts = asyncio.run(run())
    assert getattr(raised.value, "code", None) == "tenant_busy"
    assert counts == [(0, set()), (0, set())]


def test_one_replica_is_routed_without_hashing(monkeypatch):
    spec = gateway.WorkerSpec(deployment="fake-single", preset="tiny", revision={"label": "r1", "seed": 1})
    rs = gateway.replica_set(spec)
    rs.install(0, FakeHandle("only"))
    try:
        req = {"request_id": "q", "prompt": list(range(64)), "scope_salt": b"s" * 32}
        assert asyncio.run(gateway.acall(spec, "collect", req))[-1]["by"] == "only"
        router = gateway.router(spec)
        assert router.decisions["single"] == 1 and router.decisions["policy"] == 0
        assert "_route_hashes" not in req
    finally:
        gateway.forget(spec.deployment)


def test_drain_waits_for_running_requests_then_stops_the_replica(fleet):
    _, rs, ray = fleet
    rs.install(1, FakeHandle("r1"))
    rep = rs.replica(1)
    release = threading.Event()

    def hold():
        with rs.using(rep, "busy", 10):
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    _wait_for(lambda: rep.inflight == 1)
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    result = rs.drain(1, deadline_s=10)
    t.join()
    assert result == {"replica": 1, "status": "stopped", "running_at_kill": 0}
    assert ray.killed == ["r1"] and time.monotonic() - t0 >= 0.2  # it waited for the request
    assert rs.drain(5, deadline_s=1)["status"] == "absent" and ray.killed == ["r1"]


def test_drain_kills_at_its_deadline_when_requests_keep_running(fleet):
    _, rs, ray = fleet
    rs.install(1, FakeHandle("r1", running=3))
    assert rs.drain(1, deadline_s=0.1) == {"replica": 1, "status": "stopped", "running_at_kill": 3}
    assert ray.killed == ["r1"]


def test_scale_starts_missing_replicas_and_drains_the_extra_ones(fleet):
    spec, rs, ray = fleet
    rs._actor.alive = {0: FakeHandle("r0"), 3: FakeHandle("r3")}  # 3: an orphan of an older, larger count
    assert rs.scale(deadline_s=0.1) == {"started": [1], "stopped": [3]}
    assert rs._actor.launched == [1] and ray.killed == ["r3"]
    assert [r.index for r in rs.routable()] == [0, 1]


def test_routing_follows_the_registry_count():
    rs = ReplicaSet("x", join=lambda: None, actor_api=FakeActors())
    rs.update(gateway.WorkerSpec(deployment="x", preset="tiny", revision={}, replicas=3))
    assert [r.index for r in rs.routable()] == [0, 1, 2]
    rs.replica(1).draining = True
    assert [r.index for r in rs.routable()] == [0, 2]
    rs.update(gateway.WorkerSpec(deployment="x", preset="tiny", revision={}, replicas=1))
    assert [r.index for r in rs.routable()] == [0] and rs.indices() == [0]


def test_placement_uses_gpus_then_worker_nodes_then_anywhere():
    assert worker_actor.placement({"CPU": 8, "GPU": 2, "strata_worker": 4}) == {
        "num_gpus": 1, "scheduling_strategy": "SPREAD"}
    assert worker_actor.placement({"CPU": 8, "strata_worker": 4}) == {
        "num_gpus": 0, "resources": {"strata_worker": 1}, "scheduling_strategy": "SPREAD"}
    assert worker_actor.placement({"CPU": 2}) == {"num_gpus": 0, "scheduling_strategy": "SPREAD"}
    assert "resources" not in worker_actor.placement({"CPU": 2, "strata_worker": 0})


# ---------------------------------------------------------------------- jobs and stats on every replica
@pytest.fixture
def two_replicas(db, actor, monkeypatch):
    from controlplane.jobs import services
    from controlplane.registry.services import model_create, model_set_replicas

    monkeypatch.setattr(gateway, "apply_scale", lambda spec, **kw: None)
    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    deployment = model_create(actor=actor, name="tiny-two", preset="tiny", revision={"label": "r1", "seed": 4})
    return model_set_replicas(actor=actor, deployment=deployment, replicas=2)


def test_a_flush_reaches_and_verifies_every_replica(two_replicas, actor, monkeypatch):
    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob

    calls = []

    def call(spec, method, *args, replica=None, **kwargs):
        calls.append((method, replica))
        if method == "probe":
            return {"ok": True, "remaining_blocks": 0}
        return {"blocks_freed": 1 + replica}

    monkeypatch.setattr(gateway, "call", call)
    job = services.flush_job_request(actor=actor, scope="model", model="tiny-two", reason="test")
    job = services.job_execute(job_id=job.pk)
    assert job.status == FlushJob.Status.SUCCEEDED and job.verified
    assert {k: v["blocks_freed"] for k, v in job.results.items()} == {
        "cache-worker:tiny-two:0": 1, "cache-worker:tiny-two:1": 2}
    assert sorted(calls) == [("flush", 0), ("flush", 1), ("probe", 0), ("probe", 1)]
    verified = next(s for s in job.steps if s["step"] == "verified")
    assert set(verified["replicas"]) == {"cache-worker:tiny-two:0", "cache-worker:tiny-two:1"}


def test_a_replica_that_does_not_answer_makes_the_flush_partial(two_replicas, actor, monkeypatch):
    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob

    def call(spec, method, *args, replica=None, **kwargs):
        if replica == 1:
            raise Unavailable("replica 1 did not answer")
        return {"ok": True} if method == "probe" else {"blocks_freed": 1}

    monkeypatch.setattr(gateway, "call", call)
    job = services.flush_job_request(actor=actor, scope="model", model="tiny-two", reason="test")
    job = services.job_execute(job_id=job.pk, final_attempt=True)
    assert job.status == FlushJob.Status.PARTIAL and not job.verified
    assert job.results["cache-worker:tiny-two:0"]["status"] == "ok"
    assert job.results["cache-worker:tiny-two:1"]["status"] == "failed"
    verify = next(s for s in job.steps if s["step"] == "verify_failed")
    assert verify["replicas"]["cache-worker:tiny-two:1"] == {"ok": False, "reason": "unreachable"}


def _probe_down_on(down: int, answer: dict, monkeypatch) -> tuple[list, list[bool]]:
    """Workers that record each call (method, replica) and answer ``answer``; replica ``down``'s probe
    is refused (its L3 backend down) until the returned flag is set False."""
    calls, backend_down = [], [True]

    def call(spec, method, *args, replica=None, **kwargs):
        calls.append((method, replica))
        if method == "probe" and replica == down and backend_down[0]:
            raise Unavailable("worker tiny-two failed probe: the L3 backend did not answer")
        return {"ok": True, "remaining_blocks": 0} if method == "probe" else answer

    monkeypatch.setattr(gateway, "call", call)
    return calls, backend_down


def test_a_probe_that_fails_while_attempts_are_left_is_retried_not_recorded_partial(two_replicas, actor, monkeypatch):
    """The soak's failure: a flush reached every replica, then its verification ran while the L3
    backend was down (the probe's call refused, ``l3_unavailable``). The job retries, flushes that
    replica again and verifies, instead of ending ``partial`` on a passing fault."""
    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob

    calls, backend_down = _probe_down_on(1, {"blocks_freed": 1}, monkeypatch)
    job = services.flush_job_request(actor=actor, scope="model", model="tiny-two", reason="test")
    with pytest.raises(services.RetryLater, match="1 replica\\(s\\) not verified"):
        services.job_execute(job_id=job.pk)
    backend_down[0] = False
    job = services.job_execute(job_id=job.pk)
    assert job.status == FlushJob.Status.SUCCEEDED and job.verified and job.attempts == 2
    assert [c for c in calls if c[0] == "flush"] == [("flush", 0), ("flush", 1), ("flush", 1)]  # 1 again
    retry = next(s for s in job.steps if s["step"] == "verify_retry")
    assert retry["replicas"] == ["cache-worker:tiny-two:1"]


def test_a_rollout_whose_probe_fails_retries_the_probe_without_switching_again(two_replicas, actor, monkeypatch):
    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.services import revision_create

    revision_create(actor=actor, deployment=two_replicas, label="r2", seed=5)
    calls, backend_down = _probe_down_on(0, {"switched": True}, monkeypatch)
    job = services.rollout_request(actor=actor, model="tiny-two", revision="r2", reason="test")
    with pytest.raises(services.RetryLater, match="not verified: verifying again"):
        services.job_execute(job_id=job.pk)
    backend_down[0] = False
    job = services.job_execute(job_id=job.pk)
    assert job.status == FlushJob.Status.SUCCEEDED and job.verified and job.attempts == 2
    assert sorted(c for c in calls if c[0] != "probe") == [  # staged and switched once per replica
        ("stage_revision", 0), ("stage_revision", 1), ("switch_revision", 0), ("switch_revision", 1)]
    assert next(s for s in job.steps if s["step"] == "verify_retry")["redo"] == []


def test_stats_list_every_replica_and_metrics_label_them(two_replicas, admin_client, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.runtime import stats

    def call(spec, method, *args, replica=None, **kwargs):
        assert method == "stats"
        if replica == 1:
            raise Unavailable("down")
        return {"usage": [], "totals": {"query_tokens": 10}, "tiers": {}, "pool": {}, "bytes_per_block": 1}

    monkeypatch.setattr(gateway, "call", call)
    snap = stats.cluster_stats()
    assert [(w["replica"], w["status"]) for w in snap["workers"]] == [(0, "ok"), (1, "unreachable")]
    assert [w["routing"]["state"] for w in snap["workers"]] == ["unknown", "unknown"]  # never routed to here
    assert snap["totals"]["query_tokens"] == 10
    text = admin_client.get("/metrics").content.decode()
    up = {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
          if s.name == "strata_worker_up" and s.labels["model"] == "tiny-two"}
    assert up == {"0": 1.0, "1": 0.0}


# ---------------------------------------------------------------------- the router over its index
FIELDS = {"model_id": "m", "weight_digest": "w" * 8, "tokenizer_digest": "t" * 8,
          "layout": {"layers": 2, "block_size": 16}, "rope": {"theta": 10000}, "block_size": 16}


def _router_with(replica_ids):
    from controlplane.runtime.router import Router, _ReplicaView

    rs = ReplicaSet("routed", join=lambda: None, actor_api=FakeActors())
    rs.update(gateway.WorkerSpec(deployment="routed", preset="tiny", revision={}, replicas=len(replica_ids)))
    router = Router(rs)
    for i, rid in enumerate(replica_ids):
        rs.install(i, FakeHandle(rid))
        view = router._views[i] = _ReplicaView()
        view.replica_id, view.namespace_fields = rid, dict(FIELDS)
    return router


def _store(router, replica_id: str, hashes, seq: int = 1) -> None:
    from cachecore.events import BlockStored, EventBatch

    assert router.index.apply(EventBatch(replica_id=replica_id, seq=seq, ts=0.0,
                                         events=(BlockStored(tier="l1", hashes=tuple(hashes)),)))


def test_the_router_hands_the_policy_each_replica_s_reported_capacity():
    """A replica's ``router`` figures (either engine's ``info()``) reach the policy's ``ReplicaState``:
    ExpectedTTFT clips hits and weighs large writes by ``capacity_tokens``; 0 (not reported) turns that off."""
    router = _router_with(["a", "b"])
    router._views[0].router = {"cached_tokens": 64, "capacity_tokens": 4096, "queued_prefill_tokens": 32}
    a, b = (router._state(router.replicas.replica(i), router._views[i]) for i in (0, 1))
    assert (a.replica_id, a.capacity_tokens, a.cached_tokens, a.queued_prefill_tokens) == ("a", 4096, 64, 32)
    assert (b.replica_id, b.capacity_tokens, b.cached_tokens) == ("b", 0, 0)


def test_the_router_chooses_the_replica_holding_the_prefix_and_only_in_the_tenants_scope():
    from cachecore.routing.hashes import request_hashes

    router = _router_with(["a", "b"])
    prompt = list(range(1, 200))
    acme, globex = b"a" * 32, b"g" * 32
    _store(router, "b", request_hashes(FIELDS, acme, prompt)[:10])
    for turn in range(3):
        req = {"tenant": "1", "scope_salt": acme, "prompt": prompt + [turn], "request_id": f"q{turn}"}
        assert router.choose(req).index == 1  # b holds ten blocks of it; a holds nothing
    # The same tokens in another scope hash differently: no hit anywhere, so the index does not pull it to b.
    assert router.index.match(request_hashes(FIELDS, globex, prompt), 16) == {}
    assert router.decisions["policy"] == 3


def test_a_prefix_dispatched_but_not_yet_cached_pulls_its_followers_to_the_same_replica():
    """The live router hands the policy the request's chain hashes: a request sharing the prefix of
    one still queued on a replica (nothing cached anywhere yet) follows it there, instead of the
    tie-break spreading it to the other replica and prefilling the prefix twice."""
    router = _router_with(["a", "b"])
    for view in router._views.values():
        view.router = {"queued_requests": 2}  # both replicas report a queue: their dispatches are waiting
    prompt = list(range(1, 200))
    # Different end users (no stickiness between them) sharing one long system prompt.
    first = router.choose({"tenant": "1", "scope_salt": b"a" * 32, "prompt": prompt + [1], "user": "u1"})
    for turn in range(2, 5):
        req = {"tenant": "1", "scope_salt": b"a" * 32, "prompt": prompt + [turn], "user": f"u{turn}"}
        assert router.choose(req).index == first.index
    # Another tenant's identical tokens hash differently: no pull, the tie-break sends it elsewhere.
    other = router.choose({"tenant": "2", "scope_salt": b"g" * 32, "prompt": prompt + [1], "user": "u1"})
    assert other.index != first.index


def test_a_served_miss_corrects_the_index():
    from cachecore.routing.hashes import request_hashes

    router = _router_with(["a", "b"])
    prompt = list(range(1, 100))
    hashes = request_hashes(FIELDS, b"a" * 32, prompt)
    _store(router, "b", hashes)
    req = {"tenant": "1", "scope_salt": b"a" * 32, "prompt": prompt}
    rep = router.choose(req)
    assert rep.index == 1 and router.index.match(hashes, 16)
    router.served(rep, req, 0)  # b re-checked and had none of it (evicted since its events)
    assert router.index.match(hashes, 16) == {}


def test_a_replica_never_started_is_not_down(admin_client, monkeypatch, actor):
    """``strata_worker_up`` 0 means a started replica that does not answer: a model never used is
    ``strata_worker_state{state="not_started"}``, with no ``up`` sample to fire an alert."""
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway, stats

    model_create(actor=actor, name="never-used", preset="tiny", revision={"label": "r1", "seed": 3})
    monkeypatch.setattr(gateway, "call", lambda spec, method, *a, **kw: None)  # no actor exists
    assert {w["status"] for w in stats.cluster_stats()["workers"]} == {"not started"}
    text = admin_client.get("/metrics").content.decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.labels.get("model") == "never-used"]
    assert not [s for s in samples if s.name == "strata_worker_up"]
    states = {s.labels["state"]: s.value for s in samples if s.name == "strata_worker_state"}
    assert states == {"up": 0.0, "down": 0.0, "not_started": 1.0, "starting": 0.0, "unknown": 0.0}


def test_a_model_created_or_granted_is_warmed_where_enabled(transactional_db, monkeypatch, actor,
                                                           django_capture_on_commit_callbacks):
    """``STRATA_WARM_REPLICAS=1`` (the default where ``RAY_ADDRESS`` is set): creating or granting a
    deployment starts its replicas in the background after the commit, off the request; with it off
    nothing starts."""
    from controlplane.registry.services import model_create
    from controlplane.runtime.replicas import ReplicaSet
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import tenant_create

    started = []
    monkeypatch.setattr(ReplicaSet, "start_async", lambda rs, index: started.append((rs.deployment, index)))
    monkeypatch.setenv("STRATA_WARM_REPLICAS", "0")
    with django_capture_on_commit_callbacks(execute=True):
        cold = model_create(actor=actor, name="cold-one", preset="tiny", revision={"label": "r1", "seed": 2})
    assert started == []  # not enabled: nothing starts
    monkeypatch.setenv("STRATA_WARM_REPLICAS", "1")
    with django_capture_on_commit_callbacks(execute=True):
        model_create(actor=actor, name="warm-one", preset="tiny", revision={"label": "r1", "seed": 3})
    assert started == [("warm-one", 0)]
    tenant = tenant_create(actor=actor, slug="warmco", name="Warm Co")
    with django_capture_on_commit_callbacks(execute=True):
        grant_create(actor=actor, tenant=tenant, deployment=cold)
    assert started[-1] == ("cold-one", 0)


# ------------------------------------------------------------------ calls started on another thread
def _started_on_a_thread(spec, req: dict):
    """``gateway.submit`` run on a thread of its own, as the serving view's preparation job runs it."""
    out = []
    t = threading.Thread(target=lambda: out.append(gateway.submit(spec, "collect", req)))
    t.start()
    t.join()
    return out[0]


def test_a_call_started_on_a_thread_is_answered_by_the_loops_await_once(fleet):
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0"))
    rs.install(1, FakeHandle("r1"))
    started = _started_on_a_thread(spec, {"request_id": "s1", "prompt": [1, 2, 3]})
    rep = started.rep
    assert rs.describe(rep.index)["inflight"] == 1  # counted from its submission
    events = asyncio.run(gateway.acall(spec, "collect", {"request_id": "s1", "prompt": [1, 2, 3]}, started=started))
    assert events[-1]["by"] == f"r{rep.index}"
    assert [len(rs.cached(i).collect.calls) for i in (0, 1)].count(1) == 1  # called once, in the thread
    assert rs.describe(rep.index)["inflight"] == 0


def test_a_started_call_on_a_replica_that_died_is_retried_on_another(fleet):
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0", dies=True))
    rs.install(1, FakeHandle("r1", dies=True))
    started = _started_on_a_thread(spec, {"request_id": "s2", "prompt": [1]})
    other = 1 - started.rep.index
    rs.install(other, FakeHandle(f"r{other}"))
    events = asyncio.run(gateway.acall(spec, "collect", {"request_id": "s2", "prompt": [1]}, started=started))
    assert events[-1]["by"] == f"r{other}"
    assert rs.replica(started.rep.index).dead
    assert all(rs.describe(i)["inflight"] == 0 for i in (0, 1))


def test_an_abandoned_started_call_is_cancelled_on_its_worker_and_released(fleet):
    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0"))
    rs.install(1, FakeHandle("r1"))
    started = _started_on_a_thread(spec, {"request_id": "s3", "prompt": [1]})
    gateway.abandon(started)
    assert rs.cached(started.rep.index).cancel.calls == [("s3",)]
    assert all(rs.describe(i)["inflight"] == 0 for i in (0, 1))


def test_a_replica_chosen_before_its_handle_is_known_is_called_by_the_await_and_chosen_once(fleet, monkeypatch):
    """No handle known yet: ``submit`` only chooses (the router's choice is made once per call), and
    ``acall`` looks the handle up and calls that replica; no replica routable: nothing chosen."""
    from controlplane.runtime import dispatch

    spec, rs, _ = fleet
    picks = []
    real_pick = dispatch._pick
    monkeypatch.setattr(dispatch, "_pick", lambda *a: picks.append(1) or real_pick(*a))
    started = _started_on_a_thread(spec, {"request_id": "s4", "prompt": [1]})
    assert started is not None and started.handle is None and started.ref is None
    assert rs.describe(started.rep.index)["inflight"] == 0  # nothing submitted yet
    rs._actor.alive[started.rep.index] = FakeHandle(f"r{started.rep.index}")  # what the lookup finds
    events = asyncio.run(gateway.acall(spec, "collect", {"request_id": "s4", "prompt": [1]}, started=started))
    assert events[-1]["by"] == f"r{started.rep.index}" and len(picks) == 1
    assert all(rs.describe(i)["inflight"] == 0 for i in (0, 1))
    for i in (0, 1):
        rs.install(i, FakeHandle(f"r{i}"))
        rs.mark_dead(rs.replica(i), revive=False)
    assert gateway.submit(spec, "collect", {"request_id": "s5"}) is None  # none routable: acall's 503


class _Prepared:
    def __init__(self, spec, stream: bool = False) -> None:
        self.spec, self.worker_req = spec, {"request_id": "e1", "prompt": [1]}
        self.body = type("Body", (), {"stream": stream})()


def test_early_call_cancelled_before_it_started_cancels_it_when_it_starts(fleet):
    """The view was cancelled while its preparation job ran: the call the job then starts is cancelled
    on its worker at once; in the other order, ``abandon`` cancels it; a streamed request starts none."""
    from controlplane.serving.early_call import EarlyCall

    spec, rs, _ = fleet
    rs.install(0, FakeHandle("r0"))
    rs.install(1, FakeHandle("r1"))
    cancels = lambda: sum(len(rs.cached(i).cancel.calls) for i in (0, 1))  # noqa: E731
    early = EarlyCall()
    early.abandon()
    early.start(_Prepared(spec))
    assert cancels() == 1 and early.take() is None
    early = EarlyCall()
    early.start(_Prepared(spec))
    early.abandon()
    assert cancels() == 2 and early.take() is None
    early = EarlyCall()
    early.start(_Prepared(spec, stream=True))
    assert early.take() is None and sum(len(rs.cached(i).collect.calls) for i in (0, 1)) == 2
    assert all(rs.describe(i)["inflight"] == 0 for i in (0, 1))
