"""Admission in front of either engine, over HTTP (``engine_platform``: the reference engine and
vLLM): a tenant's concurrent-request slots and in-flight tokens are bounded on the replica (429 with
Retry-After, other tenants unaffected), a client that disconnects stops its request on the worker,
and suspending a tenant ends its running stream with ``request_stopped``."""

from __future__ import annotations

import json
import time

import httpx
import pytest

LONG = {"strata": 1000, "vllm": 2000}  # most of each test model's context: the stream stays open


@pytest.fixture
def platform(engine_platform):
    return engine_platform


def _set(tenant, **quotas) -> None:
    for name, value in quotas.items():
        setattr(tenant, name, value)
    tenant.save()


def _open_stream(client: httpx.Client, platform, tenant: str, max_tokens: int):
    """A long streaming completion with its first token read (it is running on the replica)."""
    cm = client.stream("POST", f"{platform.url}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                       json={"model": platform.model, "prompt": "hello there", "max_tokens": max_tokens,
                             "temperature": 0, "stream": True, "stop": None})
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"]:
            break
    return cm, lines


def _complete(platform, tenant: str, **extra) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                      json={"model": platform.model, "prompt": "a short one", "max_tokens": 2, "temperature": 0,
                            **extra})


def _running(platform) -> int:
    from controlplane.runtime import gateway

    return gateway.call(gateway.spec_for(platform.deployment), "info")["running"]


def test_concurrency_slot_held_by_a_stream_makes_the_next_request_429(platform):
    _set(platform.tenants["acme"], max_concurrent_requests=1)
    with httpx.Client() as client:
        cm, _ = _open_stream(client, platform, "acme", max_tokens=LONG[platform.engine])
        try:
            busy = _complete(platform, "acme")
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["code"] == "tenant_busy" and int(busy.headers["Retry-After"]) >= 1
            assert _complete(platform, "globex").status_code == 200  # another tenant is not throttled
        finally:
            cm.__exit__(None, None, None)


def test_inflight_token_bound_is_429_while_the_tenant_holds_tokens_and_spares_others(platform):
    _set(platform.tenants["acme"], max_inflight_tokens=64)  # one request may exceed it alone
    with httpx.Client() as client:
        cm, _ = _open_stream(client, platform, "acme", max_tokens=LONG[platform.engine])
        try:
            over = _complete(platform, "acme")
            assert over.status_code == 429, over.text
            assert over.json()["error"]["code"] == "inflight_limit" and int(over.headers["Retry-After"]) >= 1
            assert _complete(platform, "globex").status_code == 200
        finally:
            cm.__exit__(None, None, None)


def test_a_client_that_disconnects_stops_its_request_on_the_worker(platform):
    with httpx.Client() as client:
        cm, _ = _open_stream(client, platform, "acme", max_tokens=LONG[platform.engine])
        assert _running(platform) >= 1
        cm.__exit__(None, None, None)  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while _running(platform):
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.1)


def test_suspending_a_tenant_ends_its_running_stream_with_request_stopped(platform, actor):
    from controlplane.tenants.services import tenant_update

    with httpx.Client() as client:
        cm, lines = _open_stream(client, platform, "acme", max_tokens=LONG[platform.engine])
        try:
            tenant_update(actor=actor, tenant=platform.tenants["acme"], status="suspended")
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        finally:
            cm.__exit__(None, None, None)
    errors = [json.loads(e) for e in rest if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[-1]["error"]["code"] == "request_stopped"
