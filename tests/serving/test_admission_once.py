"""The serving path stays lean after the admission steps (issue 17, item 1, follow-up), over HTTP:
``serving.gate`` looks the key up and counts the request once, before the body is read, and hands its
``Admission`` to the view (no second lookup), and a key used again while nothing changed is not looked
up at all (``access_cache``); a small completion is then handled whole on a serving database thread,
while chats and larger bodies are parsed and rendered in the render pool.

The key's security properties hold at the gate: a revoked key is 401 and a suspended tenant 403 there,
without the body being read.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.serving import admission_helpers
from tests.serving.admission_helpers import MODEL, err, post
from tests.serving.test_admission_gate import _headers_only

keys, server_url = admission_helpers.keys, admission_helpers.server_url  # the fixtures, by name

# refused by the exact check once tokenized (prompt + max_tokens over the 1,024-token context): every
# admission step runs, and no worker is needed
OVER_CONTEXT = {"model": MODEL, "prompt": "hello", "max_tokens": 1020}


@pytest.fixture
def lookups(monkeypatch):
    """The key lookups (``tenant_authenticate``) and ``api_key_mark_used`` calls the server makes."""
    from controlplane.tenants import selectors, services

    seen: list[str] = []
    real_lookup, real_mark = selectors.tenant_authenticate, services.api_key_mark_used
    monkeypatch.setattr(selectors, "tenant_authenticate", lambda key: seen.append("lookup") or real_lookup(key))
    monkeypatch.setattr(services, "api_key_mark_used", lambda **kw: seen.append("mark_used") or real_mark(**kw))
    return seen


@pytest.fixture
def threads(monkeypatch):
    """The name of the thread each admission stage ran in, by stage."""
    from controlplane.serving import admission, context, intake

    seen: dict[str, str] = {}

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = threading.current_thread().name
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(admission, "admit", record("admit", admission.admit))
    monkeypatch.setattr(intake, "decode_body", record("decode", intake.decode_body))
    monkeypatch.setattr(intake, "tokenize", record("tokenize", intake.tokenize))
    monkeypatch.setattr(context, "_finish", record("finish", context._finish))
    return seen


def test_a_request_through_the_gate_looks_its_key_up_once(server_url, keys, lookups):
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 400, "context_length_exceeded")
    assert lookups == ["lookup", "mark_used"]
    lookups.clear()
    # the key again, nothing changed: served from the access cache, no lookup (still marked used)
    err(post(server_url, keys["acme"], "/v1/kv/lookup", {"model": MODEL, "tokens": [1] * 2000}), 413,
        "context_length_exceeded")
    assert lookups == ["mark_used"]


def test_a_request_the_gate_did_not_admit_is_admitted_by_the_view(keys, lookups, threads):
    """Paired with the above: without the gate's ``Admission`` (Django's test client: no ASGI scope) the
    view authenticates, counts and bounds the request itself, and still only once."""
    from django.test import Client

    client = Client(headers={"Authorization": f"Bearer {keys['acme']}"})
    resp = client.post("/v1/completions", data=OVER_CONTEXT, content_type="application/json")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert lookups == ["lookup", "mark_used"] and "admit" in threads


def test_the_gate_refuses_a_revoked_key_and_a_suspended_tenant_without_reading_the_body(server_url, keys, actor,
                                                                                        lookups):
    from controlplane.tenants.models import ApiKey, Tenant
    from controlplane.tenants.services import api_key_create, api_key_revoke

    first = ApiKey.objects.get(tenant=keys["tenant"])
    second = api_key_create(actor=actor, tenant=keys["tenant"])[1]
    api_key_revoke(actor=actor, api_key=first)
    status, body, _ = _headers_only(server_url, keys["acme"], 4000)  # announces a body, sends none
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert "mark_used" not in lookups
    # the status alone (``tenant_update`` would also reach out to every replica to stop running requests,
    # and there are none here)
    Tenant.objects.filter(pk=keys["tenant"].pk).update(status=Tenant.Status.SUSPENDED)
    status, body, _ = _headers_only(server_url, second, 4000)
    assert (status, body["error"]["code"]) == (403, "tenant_suspended")
    assert "mark_used" not in lookups


def test_a_small_completion_is_admitted_on_the_database_threads_without_the_render_pool(server_url, keys,
                                                                                       threads):
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 400, "context_length_exceeded")
    assert set(threads) == {"admit", "decode", "tokenize", "finish"}
    assert all(name.startswith("strata-serving-db") for name in threads.values()), threads


def test_chats_and_larger_bodies_are_parsed_and_rendered_in_the_render_pool(server_url, keys, threads):
    """Paired with the above: a chat (its template may be costly whatever its size) and a completion
    body over ``INLINE_BODY`` are parsed and tokenized in the render pool, and finished on the
    serving database threads."""
    from controlplane.serving.context import INLINE_BODY

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1020}
    err(post(server_url, keys["acme"], "/v1/chat/completions", chat), 400, "context_length_exceeded")
    assert threads["decode"].startswith("strata-render") and threads["tokenize"].startswith("strata-render")
    assert threads["finish"].startswith("strata-serving-db") and threads["admit"].startswith("strata-serving-db")
    threads.clear()
    big = {"model": MODEL, "prompt": "x" * (INLINE_BODY + 1)}  # over the tenant's 256 tokens, known unparsed
    err(post(server_url, keys["acme"], "/v1/completions", big), 413, "prompt_too_long")
    assert threads["decode"].startswith("strata-render") and "tokenize" not in threads


def test_bad_keys_are_throttled_at_the_gate_and_a_valid_key_from_their_source_is_still_admitted(server_url, keys):
    """``keyguard`` at the gate: past ``FAILURE_LIMIT`` bad keys from one source (this test's 127.0.0.1),
    the next is 429 without its body being read, while the tenant's valid key from the same source is
    still admitted and answered by the view."""
    from django.core.cache import caches

    from controlplane.serving import keyguard

    bad = f"sk-st-{'B' * 43}"
    try:
        for _ in range(keyguard.FAILURE_LIMIT):
            status, body, _ = _headers_only(server_url, bad, 4000)
            assert (status, body["error"]["code"]) == (401, "invalid_api_key")
        status, body, retry = _headers_only(server_url, bad, 4000)
        assert (status, body["error"]["code"]) == (429, "auth_throttled") and int(retry) >= 1
        err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 400, "context_length_exceeded")
    finally:
        caches["lockouts"].clear()  # the lock on this test client's address would outlive the test


def test_djangos_per_request_steps_of_an_admitted_request_run_on_a_lane_thread(server_url, keys):
    """``serving.lanes``: ``request_started`` and ``request_finished`` of a request the gate admitted run
    on a long-lived lane thread, not on a thread started for the request (paired: a request the gate
    does not admit, ``GET /v1/models``, still gets Django's own thread)."""
    import httpx
    from django.core.signals import request_finished, request_started

    seen: list[str] = []

    def record(**kwargs):
        seen.append(threading.current_thread().name)

    def both_steps() -> list[str]:
        deadline = time.monotonic() + 10  # request_finished runs after the response was sent
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(seen)

    request_started.connect(record, dispatch_uid="lane-test-started")
    request_finished.connect(record, dispatch_uid="lane-test-finished")
    try:
        err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 400, "context_length_exceeded")
        steps = both_steps()
        assert len(steps) == 2 and all(name.startswith("strata-serving-lane") for name in steps), steps
        seen.clear()
        assert httpx.get(f"{server_url}/v1/models", headers={"Authorization": f"Bearer {keys['acme']}"},
                         timeout=60).status_code == 200
        steps = both_steps()
        assert len(steps) == 2 and not any(name.startswith("strata-serving-lane") for name in steps), steps
    finally:
        request_started.disconnect(dispatch_uid="lane-test-started")
        request_finished.disconnect(dispatch_uid="lane-test-finished")
