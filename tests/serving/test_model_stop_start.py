"""Stopping and starting a deployment (issue 44, item 2), over HTTP against the real server and a real
local Ray: ``PATCH /api/admin/models/{name}`` ``{"replicas": 0}`` drains and kills every replica
(its L3 objects stay), tenants then get 503 ``model_stopped`` with ``Retry-After`` on every path that
needs a replica, and nothing starts one; a positive count starts it again in the background and the
restarted replica serves what the stopped one served."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # several full blocks


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

    _, raw = operator_token_create(actor=Actor.system("tests"), username="stopper", role="admin")
    with httpx.Client(base_url=platform.url, headers={"Authorization": f"Bearer {raw}"}, timeout=120) as client:
        yield client


def _tenant(platform, slug: str = "acme") -> httpx.Client:
    return httpx.Client(base_url=platform.url, headers={"Authorization": f"Bearer {platform.keys[slug]}"},
                        timeout=120)


def _complete(client: httpx.Client, model: str, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                 "temperature": 0, **extra})


def _l3_files() -> set[Path]:
    import os

    root = Path(urlparse(os.environ["STRATA_L3_URL"]).path)
    return {p for p in root.rglob("*") if p.is_file()}


def _states(admin: httpx.Client, model: str) -> list[dict]:
    answer = admin.get(f"/api/admin/models/{model}")
    assert answer.status_code == 200, answer.text
    return answer.json()["replica_states"]


def _assert_stopped_error(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_stopped"
    assert int(response.headers["Retry-After"]) >= 1


def test_stopping_drains_kills_the_replica_keeps_l3_and_refuses_every_path(platform, admin, monkeypatch):
    from controlplane.runtime import gateway
    from workers import actor as worker_actor

    model = platform.model
    gateway.forget(model)
    before_l3 = _l3_files()
    with _tenant(platform) as tenant:
        first = _complete(tenant, model)
        assert first.status_code == 200, first.text
        uncached = first.json()["choices"][0]["text"]
        assert worker_actor.find(model, 0) is not None
        written = _until("the prompt's KV written to L3", lambda: _l3_files() - before_l3)

        answer = admin.patch(f"/api/admin/models/{model}", json={"replicas": 0, "reason": "night"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["replicas"] == 0 and answer.json()["status"] == "stopped"
        _until("the replica's actor gone", lambda: worker_actor.find(model, 0) is None)
        assert written <= _l3_files()  # stopping keeps the cached KV on disk

        launches = []
        monkeypatch.setattr(worker_actor, "launch", lambda *a, **kw: launches.append(a))
        _assert_stopped_error(_complete(tenant, model))
        _assert_stopped_error(_complete(tenant, model, stream=True))  # before any byte of the stream
        _assert_stopped_error(tenant.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        _assert_stopped_error(tenant.get("/v1/kv/layout", params={"model": model}))
        _assert_stopped_error(tenant.post("/v1/caches", json={"model": model, "prompt": PROMPT}))
        assert launches == [] and worker_actor.find(model, 0) is None  # nothing tried to start it
        assert model in [m["id"] for m in tenant.get("/v1/models").json()["data"]]  # still listed

        assert [s["state"] for s in _states(admin, model)] == ["stopped"]
        ready = admin.get("/readyz").json()
        assert ready["replicas"][model]["status"] == "stopped"
        assert [s["state"] for s in ready["replicas"][model]["states"]] == ["stopped"]
        events = admin.get("/api/admin/audit", params={"action": "model.scale"}).json()["items"]
        assert any(e["old"] == {"replicas": 1} and e["new"] == {"replicas": 0} for e in events)
        monkeypatch.undo()

        answer = admin.patch(f"/api/admin/models/{model}", json={"replicas": 1})
        assert answer.status_code == 200 and answer.json()["status"] == "running"  # answered at once
        assert _states(admin, model)[0]["state"] in ("starting", "ready")
        _until("the replica ready again", lambda: _states(admin, model)[0]["state"] == "ready")
        again = _complete(tenant, model)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == uncached  # cached output equals uncached
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # from the kept L3


def test_a_stopped_model_answers_admin_reads_and_can_be_stopped_twice(platform, admin):
    model = platform.model
    for _ in range(2):
        answer = admin.patch(f"/api/admin/models/{model}", json={"replicas": 0})
        assert answer.status_code == 200 and answer.json()["replicas"] == 0
    assert admin.get("/api/admin/models").status_code == 200
    bad = admin.patch(f"/api/admin/models/{model}", json={"replicas": -1})
    assert bad.status_code == 422 and "error" in bad.json()
    admin.patch(f"/api/admin/models/{model}", json={"replicas": 1})  # leave it running for the next tests
