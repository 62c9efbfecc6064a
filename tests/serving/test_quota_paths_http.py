"""Every quota on every path, mounted over HTTP against the real server (uvicorn + Ray worker):

- KV lookup/store/retrieve obey ``max_prompt_tokens`` (413) and tokens-per-minute (lookups count their
  tokens too);
- a KV call while the tenant's only concurrent slot is held by a streaming completion is a 429 with
  Retry-After;
- suspending a tenant ends its running stream with a retryable ``request_stopped`` error and no more
  tokens, and its running non-streamed completion with a 503 ``request_stopped`` and Retry-After (its
  client still waits: not the 499 of a client that went away).
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

SLOW = "small-quota"
REVISION = {"label": "r1", "seed": 5}


def _kv(platform, tenant: str, op: str, body: dict, model: str | None = None) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/kv/{op}", json={"model": model or platform.model, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys[tenant]}"})


def _set(tenant, **quotas) -> None:
    for name, value in quotas.items():
        setattr(tenant, name, value)
    tenant.save()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_calls_longer_than_max_prompt_tokens_are_413(platform):
    _set(platform.tenants["acme"], max_prompt_tokens=64, max_concurrent_requests=1)
    tokens = _tokens(1024, 1)
    page = _kv(platform, "acme", "lookup", {"tokens": tokens[:64]})
    assert page.status_code == 200, page.text  # within the bound: served
    layout = httpx.get(f"{platform.url}/v1/kv/layout", params={"model": platform.model},
                       headers={"Authorization": f"Bearer {platform.keys['acme']}"}).json()
    kv = torch.zeros(1024 // layout["block_size"], *layout["page_shape"])
    for op, body in (("lookup", {"tokens": tokens}), ("retrieve", {"tokens": tokens}),
                     ("store", {"tokens": tokens, "kv": base64.b64encode(kv.numpy().tobytes()).decode()})):
        resp = _kv(platform, "acme", op, body)
        assert resp.status_code == 413, (op, resp.text)
        assert resp.json()["error"]["code"] == "prompt_too_long" and "64" in resp.json()["error"]["message"]
    assert _kv(platform, "globex", "lookup", {"tokens": tokens}).status_code == 200  # another tenant's bound


def test_kv_lookups_count_their_tokens_against_tokens_per_minute(platform):
    _set(platform.tenants["initech"], tokens_per_minute=100)
    tokens = _tokens(60, 2)
    assert _kv(platform, "initech", "lookup", {"tokens": tokens}).status_code == 200
    over = _kv(platform, "initech", "retrieve", {"tokens": tokens})  # 120 tokens this minute > 100
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_tokens"
    assert int(over.headers["Retry-After"]) >= 1


@pytest.fixture
def slow(platform, actor):
    """A deployment of the ``small`` model: decoding takes seconds, so a stream stays open while the
    test acts."""
    import ray

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name=SLOW, preset="small", revision=dict(REVISION))
    for tenant in platform.tenants.values():
        grant_create(actor=actor, tenant=tenant, deployment=deployment)
    handle = worker_actor.launch(SLOW, "small", dict(REVISION), l1_mb=64, l2_mb=0)
    ray.get(handle.ping.remote())
    yield gateway.spec_for(deployment)
    gateway.forget(SLOW)
    ray.kill(handle)


def _open_stream(client: httpx.Client, platform, tenant: str):
    """A streaming completion of 2,000 tokens on the slow model, its first token read (it is running)."""
    cm = client.stream("POST", f"{platform.url}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                       json={"model": SLOW, "prompt": "hello", "max_tokens": 2000, "temperature": 0, "stream": True})
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"] is not None:
            break
    return cm, lines


def _events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_a_kv_call_while_the_only_slot_streams_is_429(platform, slow):
    _set(platform.tenants["acme"], max_concurrent_requests=1)
    with httpx.Client() as client:
        cm, _ = _open_stream(client, platform, "acme")
        try:
            busy = _kv(platform, "acme", "lookup", {"tokens": _tokens(32, 3)}, model=SLOW)
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["code"] == "tenant_busy" and int(busy.headers["Retry-After"]) >= 1
            calm = _kv(platform, "globex", "lookup", {"tokens": _tokens(32, 3)}, model=SLOW)
            assert calm.status_code == 200  # another tenant is not throttled
        finally:
            cm.__exit__(None, None, None)


def test_suspending_a_tenant_ends_its_running_stream_with_request_stopped(platform, slow, actor):
    from controlplane.tenants.services import tenant_update

    with httpx.Client() as client:
        cm, lines = _open_stream(client, platform, "acme")
        try:
            tenant_update(actor=actor, tenant=platform.tenants["acme"], status="suspended")
            rest = _events(lines)  # returns: the stream ended (it would run for 2,000 tokens otherwise)
        finally:
            cm.__exit__(None, None, None)
    errors = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert rest[-1] == "[DONE]" and len(errors) == 1 and errors[0]["error"]["code"] == "request_stopped"
    after = rest[rest.index(errors[0]):]
    assert not any(isinstance(e, dict) and e.get("choices") for e in after)  # no token after the cancel
    tokens_before = sum(1 for e in rest if isinstance(e, dict) and e.get("choices"))
    assert tokens_before < 1990  # stopped, not run to its end
    from controlplane.audit.models import AuditEvent

    assert AuditEvent.objects.filter(action="tenant.requests_stopped", tenant="acme").exists()


def test_suspending_a_tenant_answers_its_running_completion_503_request_stopped(platform, slow, actor):
    import threading
    import time

    from controlplane.runtime import gateway
    from controlplane.tenants.services import tenant_update

    tenant = platform.tenants["globex"]
    answer: list[httpx.Response] = []
    call = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{platform.url}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {platform.keys['globex']}"},
        json={"model": SLOW, "prompt": "hello there", "max_tokens": 2000, "temperature": 0})))
    call.start()
    try:
        deadline = time.monotonic() + 60
        while gateway.call(slow, "info")["running"] < 1:
            assert time.monotonic() < deadline and call.is_alive(), answer and answer[0].text
            time.sleep(0.05)
        tenant_update(actor=actor, tenant=tenant, status="suspended")
        call.join(timeout=60)
    finally:
        tenant_update(actor=actor, tenant=tenant, status="active")
    resp = answer[0]
    assert resp.status_code == 503, resp.text  # the client is still there: told to retry, not 499
    assert resp.json()["error"]["code"] == "request_stopped" and "tenant suspended" in resp.json()["error"]["message"]
    assert int(resp.headers["Retry-After"]) >= 1
