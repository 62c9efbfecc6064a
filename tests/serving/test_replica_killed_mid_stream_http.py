"""A replica killed mid-stream (issue 24), over HTTP against the real server (uvicorn + a real Ray actor):

the streaming completion ends, without hanging, with one retryable SSE ``error`` event (503's
``service_unavailable_error``, code ``worker_failed``, ``retryable`` and ``retry_after``) then ``[DONE]``,
and no token after it; the tenant's in-flight accounting is freed (nothing left in flight on the
replica in this process), so with ``max_concurrent_requests = 1`` the tenant's next request is admitted
once the replica is back (revived in the background), never refused as ``tenant_busy``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

MODEL = "small-killed"
REVISION = {"label": "r1", "seed": 7}


@pytest.fixture
def slow(platform, actor):
    """A deployment of the ``small`` model (decoding takes seconds: the stream is open while the test
    acts), granted to every tenant, its replica started."""
    import ray

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name=MODEL, preset="small", revision=dict(REVISION))
    for tenant in platform.tenants.values():
        grant_create(actor=actor, tenant=tenant, deployment=deployment)
    handle = worker_actor.launch(MODEL, "small", dict(REVISION), l1_mb=64, l2_mb=0)
    ray.get(handle.ping.remote())
    yield gateway.spec_for(deployment)
    gateway.forget(MODEL)
    revived = worker_actor.find(MODEL)
    if revived is not None:
        ray.kill(revived, no_restart=True)


def _headers(platform, tenant: str) -> dict:
    return {"Authorization": f"Bearer {platform.keys[tenant]}"}


def _data(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_a_replica_killed_mid_stream_ends_it_with_a_retryable_error_and_frees_the_tenant(platform, slow):
    import ray

    from controlplane.runtime import cluster
    from workers import actor as worker_actor

    tenant = platform.tenants["acme"]
    tenant.max_concurrent_requests = 1
    tenant.save()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2000, "temperature": 0, "stream": True}
    client = httpx.Client(timeout=httpx.Timeout(120, read=60))  # a hang fails the read, not the run
    with client, client.stream("POST", f"{platform.url}/v1/completions", json=body,
                               headers=_headers(platform, "acme")) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"] is not None:
                break  # a token arrived: the request runs on the replica
        rs = cluster.known_set(MODEL)
        assert rs is not None and rs.replica(0).inflight == 1

        ray.kill(worker_actor.find(MODEL), no_restart=True)
        rest = _data(lines)  # returns: the stream ended (2,000 tokens would take minutes)

    assert rest[-1] == "[DONE]"
    errors = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, rest
    error = errors[0]["error"]
    assert error["code"] == "worker_failed" and error["type"] == "service_unavailable_error"
    assert error["retryable"] is True and error["retry_after"] >= 1
    assert rest.index(errors[0]) == len(rest) - 2  # nothing but [DONE] after it
    assert rs.replica(0).inflight == 0 and not rs.replica(0).requests  # in-flight accounting freed

    # The tenant's only slot is free: once the replica is back its next request is served. While it
    # is revived the answer is a 503 with Retry-After; a 429 tenant_busy would mean a leaked slot.
    deadline = time.monotonic() + 180
    while True:
        resp = httpx.post(f"{platform.url}/v1/completions", headers=_headers(platform, "acme"), timeout=120,
                          json={"model": MODEL, "prompt": "again", "max_tokens": 2, "temperature": 0})
        if resp.status_code == 200:
            break
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
        assert time.monotonic() < deadline, "the replica was not revived within 180 s"
        time.sleep(1)
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert rs.replica(0).inflight == 0
