"""Warm starts and starting replicas (issue 44, item 3), over HTTP against the real server and a real
local Ray: the platform's startup hook starts every deployment's replicas, so the first request
after a restart starts no engine; a request that meets a starting replica waits a bounded time and
gets 503 ``model_starting`` with ``Retry-After``; a replica that failed to start is 503
``replica_failed`` with its error; operators see each replica's state in ``/readyz`` and the admin
API."""

from __future__ import annotations

import time

import httpx
import pytest

PROMPT = "Warm starts keep the first request fast. " * 4


def _until(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.1)


@pytest.fixture
def admin(platform):
    from controlplane.common.actor import Actor
    from controlplane.operators.services import operator_token_create

    _, raw = operator_token_create(actor=Actor.system("tests"), username="warmer", role="admin")
    with httpx.Client(base_url=platform.url, headers={"Authorization": f"Bearer {raw}"}, timeout=120) as client:
        yield client


def _complete(platform, model: str) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/completions", headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                      json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}, timeout=120)


def _states(admin: httpx.Client, model: str) -> list[dict]:
    answer = admin.get(f"/api/admin/models/{model}")
    assert answer.status_code == 200, answer.text
    return answer.json()["replica_states"]


def _deployment(platform, actor, name: str):
    """A new tiny deployment granted to acme, with no replica running and none known to this process."""
    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    for index in range(2):
        if (old := worker_actor.find(name, index)) is not None:  # left by an earlier test of the session
            import ray

            ray.kill(old, no_restart=True)
    _until("no replica left", lambda: worker_actor.find(name, 0) is None)
    gateway.forget(name)
    deployment = model_create(actor=actor, name=name, preset="tiny", revision={"label": "r1", "seed": 9})
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=deployment)
    return deployment


def _kill(name: str) -> None:
    import ray

    from controlplane.runtime import gateway
    from workers import actor as worker_actor

    gateway.forget(name)
    if (handle := worker_actor.find(name, 0)) is not None:
        ray.kill(handle, no_restart=True)


@pytest.fixture
def launches(monkeypatch):
    """Every replica launch this process makes, recorded (and still made)."""
    from workers import actor as worker_actor

    made, real = [], worker_actor.launch

    def launch(deployment, *args, **kwargs):
        made.append((deployment, kwargs.get("replica", 0)))
        return real(deployment, *args, **kwargs)

    monkeypatch.setattr(worker_actor, "launch", launch)
    return made


def test_the_startup_hook_starts_replicas_so_the_first_request_starts_no_engine(platform, actor, admin,
                                                                              launches, monkeypatch):
    from controlplane.runtime import gateway, warm
    from workers import actor as worker_actor

    name = "warm-restart"
    _deployment(platform, actor, name)
    stopped = _deployment(platform, actor, "warm-stopped")
    stopped.replicas = 0
    stopped.save(update_fields=["replicas"])
    assert worker_actor.find(name, 0) is None
    monkeypatch.setenv("STRATA_WARM_REPLICAS", "0")
    assert warm.start_at_startup() is None  # turned off: nothing starts
    monkeypatch.setenv("STRATA_WARM_REPLICAS", "1")
    try:
        thread = warm.start_at_startup()  # what the web process does when it starts (controlplane.asgi)
        thread.join(60)
        _until("the warm replica launched", lambda: (name, 0) in launches)
        _until("the warm replica ready", lambda: _states(admin, name)[0]["state"] == "ready")
        assert not [d for d, _ in launches if d == "warm-stopped"]
        before = worker_actor.find(name, 0)
        assert before is not None
        gateway.forget(name)  # as a web process that restarted: it holds no handle, the actor runs
        launches.clear()
        first = _complete(platform, name)
        assert first.status_code == 200, first.text
        assert launches == []  # the first request started no engine...
        assert worker_actor.find(name, 0)._actor_id == before._actor_id  # ...it found the running one
        assert worker_actor.find("warm-stopped", 0) is None  # a stopped deployment stays stopped
    finally:
        _kill(name)


def test_a_request_meeting_a_starting_replica_gets_503_model_starting_then_is_served(platform, actor, admin,
                                                                                     launches, monkeypatch,
                                                                                     settings):
    from workers import actor as worker_actor

    name = "slow-start"
    _deployment(platform, actor, name)
    settings.STRATA_START_WAIT_SECONDS = 0.5
    real = worker_actor.launch
    monkeypatch.setattr(worker_actor, "launch", lambda *a, **kw: real(*a, start_delay_s=20.0, **kw))
    try:
        waiting = _complete(platform, name)
        assert waiting.status_code == 503, waiting.text
        assert waiting.json()["error"]["code"] == "model_starting"
        assert int(waiting.headers["Retry-After"]) >= 1
        # answered while the replica was still starting: the wait was bounded, not the start's length
        state = _states(admin, name)[0]
        assert state["state"] == "starting" and state["elapsed_s"] >= 0
        # the actor's own report of its phase, once its process runs
        _until("the actor's phase", lambda: _states(admin, name)[0].get("phase") == "test hook: a slow start")
        ready = admin.get("/readyz").json()
        assert ready["replicas"][name]["states"][0]["state"] == "starting"
        again = _complete(platform, name)  # a second request joins the same start: still bounded
        assert again.status_code == 503 and again.json()["error"]["code"] == "model_starting"
        assert launches == [(name, 0)]  # one start, not one per request
        settings.STRATA_START_WAIT_SECONDS = 60.0
        _until("the replica ready", lambda: _states(admin, name)[0]["state"] == "ready")
        served = _complete(platform, name)
        assert served.status_code == 200, served.text
        assert launches == [(name, 0)]
    finally:
        _kill(name)


def test_a_replica_that_failed_to_start_is_503_with_its_error_and_shown_failed(platform, actor, admin,
                                                                               monkeypatch):
    from workers import actor as worker_actor

    name = "broken-start"
    _deployment(platform, actor, name)
    real = worker_actor.launch
    monkeypatch.setattr(worker_actor, "launch", lambda *a, **kw: real(*a, no_such_option=1, **kw))
    try:
        failed = _complete(platform, name)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "replica_failed"
        assert "no_such_option" in failed.json()["error"]["message"]
        assert int(failed.headers["Retry-After"]) >= 1
        assert "Traceback" not in failed.text
        state = _states(admin, name)[0]
        assert state["state"] == "failed" and "no_such_option" in state["error"]
        ready = admin.get("/readyz").json()
        assert ready["replicas"][name]["states"][0]["state"] == "failed"
        held = _complete(platform, name)  # not started again from every request
        assert held.status_code == 503 and held.json()["error"]["code"] == "replica_failed"
        anonymous = httpx.get(f"{platform.url}/readyz").json()
        assert "replicas" not in anonymous  # operator detail only
    finally:
        _kill(name)
