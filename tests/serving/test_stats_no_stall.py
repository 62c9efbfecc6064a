"""No admin read waits on a replica: ``GET /api/admin/stats`` and ``/metrics`` answer from the last
sample of each replica (``controlplane.runtime.samples``) while one is starting or does not answer,
with the sample's age and ``stale``; the samples are refreshed in the background afterwards.

Real local Ray; the replica is a stand-in actor under the replica's name whose constructor (a replica
still loading) or ``stats`` (a replica that does not answer) blocks on a file the test creates. The
reads run with the production bounds (the test settings otherwise make every read poll and wait).
Times are printed, never asserted: what is asserted is that the request thread made no Ray call."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
from django.test import Client

from workers.actor import NAMESPACE, actor_name

pytestmark = pytest.mark.django_db

SNAP = {"usage": [], "totals": {"query_tokens": 7}, "tiers": {}, "pool": {"total": 4, "free": 4},
        "bytes_per_block": 64}


class StandIn:
    """A replica: constructed once ``start_gate`` exists; ``stats`` blocks while ``stall_gate`` exists."""

    def __init__(self, start_gate: str, stall_gate: str) -> None:
        while not Path(start_gate).exists():
            time.sleep(0.05)
        self.stall_gate, self.asked = stall_gate, 0

    def stats(self) -> dict:
        self.asked += 1
        while Path(self.stall_gate).exists():
            time.sleep(0.05)
        return {**SNAP, "asked": self.asked}

    def ping(self) -> bool:
        return True


def _until(what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def production_bounds(settings):
    from controlplane.runtime import samples

    settings.STRATA_STATS_FRESH_SECONDS = samples.FRESH_S
    settings.STRATA_STATS_READ_WAIT_SECONDS = samples.READ_WAIT_S
    settings.STRATA_STATS_INTERVAL_SECONDS = 0.5


@pytest.fixture
def ray_calls(monkeypatch):
    """The threads that called a replica (``gateway.call``) or asked Ray for an actor's state."""
    from controlplane.runtime import gateway, samples

    threads: list[str] = []
    real_call, real_state = gateway.call, samples.actor_state

    def call(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_call(*args, **kwargs)

    def state(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_state(*args, **kwargs)

    monkeypatch.setattr(gateway, "call", call)
    monkeypatch.setattr(samples, "actor_state", state)
    return threads


@pytest.fixture
def stand_in(ray_cluster, actor, tmp_path):
    """``(deployment name, start gate, stall gate, launch)``: ``launch()`` starts the stand-in replica."""
    import ray

    from controlplane.registry.services import model_create

    name = f"slow-{uuid.uuid4().hex[:8]}"
    model_create(actor=actor, name=name, preset="tiny", revision={"label": "r1", "seed": 4})
    start, stall = tmp_path / "started", tmp_path / "stalled"
    handles = []

    def launch():
        handles.append(ray.remote(StandIn).options(name=actor_name(name, 0), namespace=NAMESPACE, num_cpus=0,
                                                   max_concurrency=4).remote(str(start), str(stall)))
        return handles[-1]

    yield name, start, stall, launch
    start.touch()
    stall.unlink(missing_ok=True)
    for handle in handles:
        ray.kill(handle)


def _console(django_user_model) -> Client:
    user = django_user_model.objects.create_superuser("stall-admin", "stall@example.com", "pw-stall-admin-1")
    client = Client()
    client.force_login(user)
    return client


def _worker(client, name: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    response = client.get("/api/admin/stats")
    seconds = time.perf_counter() - t0
    assert response.status_code == 200, response.content
    return next(w for w in response.json()["workers"] if w["model"] == name), seconds


def test_stats_answer_from_the_cache_while_a_replica_starts_and_refresh_after(
        admin_client, stand_in, production_bounds, ray_calls, django_user_model):
    name, start, _stall, launch = stand_in
    assert admin_client.get("/api/admin/models").status_code == 200  # the process's first request, not timed
    handle = launch()  # its constructor waits for ``start``: a replica loading its weights
    from controlplane.runtime import samples

    seen = []
    for _ in range(3):
        worker, seconds = _worker(admin_client, name)
        seen.append(seconds)
        assert worker["status"] in ("pending", "starting") and worker["stale"] is True
        assert "totals" not in worker  # no figures invented
    print(f"\nGET /api/admin/stats while the replica starts: {', '.join(f'{s * 1000:.0f} ms' for s in seen)}")
    worker = _until("the replica reported as starting",
                    lambda: (w := _worker(admin_client, name)[0])["status"] == "starting" and w)
    assert worker["sampled_at"] is None and worker["age_s"] is None
    text = admin_client.get("/metrics").content.decode()
    assert f'strata_worker_state{{model="{name}",replica="0",state="starting"}} 1.0' in text
    assert f'strata_worker_up{{model="{name}",replica="0"}}' not in text  # no alert for a starting replica
    console = _console(django_user_model)
    pages = (("/ui/live/", "starting (loading its weights)"), ("/ui/models/", "capacity shows once it is up"))
    for url, shown in pages:
        t0 = time.perf_counter()
        response = console.get(url)
        print(f"GET {url} while the replica starts: {(time.perf_counter() - t0) * 1000:.0f} ms")
        assert response.status_code == 200 and shown in response.content.decode()
    assert "MainThread" not in ray_calls and ray_calls  # every Ray call ran on the sampler's threads
    assert all(t.startswith("strata-stats-poll") for t in ray_calls)

    start.touch()  # the replica is up: the background refresh picks it up without another request
    import ray

    ray.get(handle.ping.remote(), timeout=60)
    store = samples.store()
    polls = store.polls
    _until("a background poll after the start", lambda: store.polls > polls + 1)
    worker, seconds = _worker(admin_client, name)
    print(f"GET /api/admin/stats once it started: {seconds * 1000:.0f} ms, status {worker['status']}")
    assert worker["status"] == "ok" and worker["stale"] is False and worker["totals"]["query_tokens"] == 7
    assert worker["asked"] >= 1  # the stand-in was asked only once it was up (its counter starts then)
    assert "MainThread" not in ray_calls


def test_a_replica_that_stops_answering_is_shown_from_its_last_sample_marked_stale(
        admin_client, stand_in, production_bounds, ray_calls):
    name, start, stall, launch = stand_in
    start.touch()
    launch()
    first = _until("the first sample", lambda: (w := _worker(admin_client, name)[0])["status"] == "ok" and w)
    stall.touch()  # from now on ``stats`` does not answer
    stuck = _until("a poll that does not answer",
                   lambda: (w := _worker(admin_client, name)[0])["status"] == "unreachable" and w)
    worker, seconds = _worker(admin_client, name)
    print(f"\nGET /api/admin/stats while the replica does not answer: {seconds * 1000:.0f} ms")
    for w in (stuck, worker):  # the last figures, from the cache: same sample time, marked stale
        assert w["stale"] is True and w["totals"]["query_tokens"] == 7
        assert w["sampled_at"] <= stuck["sampled_at"] and w["sampled_at"] >= first["sampled_at"]
    assert "MainThread" not in ray_calls
    stall.unlink()
    fresh = _until("a fresh sample", lambda: (w := _worker(admin_client, name)[0])["stale"] is False and w)
    assert fresh["status"] == "ok" and fresh["sampled_at"] > stuck["sampled_at"]
