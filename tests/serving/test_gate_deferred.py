"""A small body that comes with its headers is read by ``serving.gate`` before admission, and the view's
preparation job admits the request (``admission.Deferred``): one hop to the serving database threads
per request instead of two (issue 23), with every check of the admission kept: revoked key 401,
suspended tenant 403, out of requests 429 (remembered by the gate), a failing database 503. A body held
back past ``gate.BODY_WAIT_S`` is admitted at the gate first, unread, as before.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from tests.serving import admission_helpers
from tests.serving.admission_helpers import MODEL

keys, server_url = admission_helpers.keys, admission_helpers.server_url  # the fixtures, by name

OVER_CONTEXT = {"model": MODEL, "prompt": "hello", "max_tokens": 1020}  # refused once tokenized: no worker


def _send(url: str, key: str, body: dict | bytes, path: str = "/v1/completions", hold_s: float = 0.0
          ) -> tuple[int, dict, dict]:
    """POST ``body`` (with its headers in one write, or ``hold_s`` after them); (status, JSON, headers)."""
    raw_body = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw_body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        if hold_s:
            sock.sendall(head)
            time.sleep(hold_s)
            sock.sendall(raw_body)
        else:
            sock.sendall(head + raw_body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read()), {n.lower(): v for n, v in resp.getheaders()}


@pytest.fixture
def hops(monkeypatch):
    """The jobs sent to the serving database threads (``db_threads.run``) and the gate's own admissions
    (``gate._aadmit``), by name."""
    from controlplane.serving import db_threads, gate

    seen: list[str] = []
    real_run, real_aadmit = db_threads.run, gate._aadmit

    async def run(fn, *args):
        seen.append("db_thread")
        return await real_run(fn, *args)

    async def aadmit(*args):
        seen.append("gate_admit")
        return await real_aadmit(*args)

    monkeypatch.setattr(db_threads, "run", run)
    monkeypatch.setattr(gate, "_aadmit", aadmit)
    return seen


@pytest.mark.parametrize("path, body", [("/v1/completions", OVER_CONTEXT),
                                        ("/v1/kv/lookup", {"model": MODEL, "tokens": [1] * 2000})])
def test_a_small_body_sent_with_its_headers_is_admitted_and_prepared_in_one_database_hop(server_url, keys, hops,
                                                                                        path, body):
    status, out, _ = _send(server_url, keys["acme"], body, path)
    assert (status, out["error"]["code"]) == (400 if path == "/v1/completions" else 413, "context_length_exceeded")
    assert hops == ["db_thread"]


def test_a_small_body_held_back_is_admitted_at_the_gate_first(server_url, keys, hops):
    """Paired with the above: a body that has not come within ``BODY_WAIT_S`` of its headers is admitted
    by the gate before it is read (two hops)."""
    from controlplane.serving.gate import BODY_WAIT_S

    status, out, _ = _send(server_url, keys["acme"], OVER_CONTEXT, hold_s=BODY_WAIT_S + 1.0)
    assert (status, out["error"]["code"]) == (400, "context_length_exceeded")
    assert hops == ["gate_admit", "db_thread", "db_thread"]


def test_a_deferred_admission_refuses_revoked_keys_and_suspended_tenants(server_url, keys, actor):
    from controlplane.tenants.models import ApiKey, Tenant
    from controlplane.tenants.services import api_key_create, api_key_revoke

    second = api_key_create(actor=actor, tenant=keys["tenant"])[1]
    assert _send(server_url, keys["acme"], OVER_CONTEXT)[0] == 400  # the key warm in the access cache
    api_key_revoke(actor=actor, api_key=ApiKey.objects.filter(tenant=keys["tenant"]).order_by("pk").first())
    status, out, _ = _send(server_url, keys["acme"], OVER_CONTEXT)
    assert (status, out["error"]["code"]) == (401, "invalid_api_key")
    Tenant.objects.filter(pk=keys["tenant"].pk).update(status=Tenant.Status.SUSPENDED)
    status, out, _ = _send(server_url, second, OVER_CONTEXT)
    assert (status, out["error"]["code"]) == (403, "tenant_suspended")


def test_a_deferred_429_is_remembered_by_the_gate(server_url, keys, actor, monkeypatch):
    """A tenant out of requests, refused by the view's admission, is refused by the gate's memory next
    (``RequestGate.REMEMBER_S``): no admission at all, even with the body held back."""
    from controlplane.serving import admission, gate
    from controlplane.tenants.services import tenant_update

    # No clock in the assertions: the memory outlives a slow machine's gaps between the requests, and
    # the three requests stay inside one minute's window (the memory never outlives its window).
    monkeypatch.setattr(gate.RequestGate, "REMEMBER_S", 30.0)
    left = 60.0 - time.time() % 60.0
    if left < 20.0:
        time.sleep(left + 0.2)
    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"requests_per_minute": 1})
    assert _send(server_url, keys["acme"], b"[]")[0] == 400
    status, out, headers = _send(server_url, keys["acme"], b"[]")
    assert (status, out["error"]["code"]) == (429, "rate_limit_requests") and int(headers["retry-after"]) >= 1
    admits: list[int] = []
    real_admit = admission.admit
    monkeypatch.setattr(admission, "admit", lambda *a, **kw: admits.append(1) or real_admit(*a, **kw))
    status, out, headers = _send(server_url, keys["acme"], b"[]")
    assert (status, out["error"]["code"]) == (429, "rate_limit_requests") and headers["connection"] == "close"
    assert admits == []


def test_a_database_that_fails_during_a_deferred_admission_is_a_retryable_json_503(server_url, keys, monkeypatch):
    from django.db import OperationalError

    from controlplane.serving import admission

    def down(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(admission, "admit", down)
    status, out, headers = _send(server_url, keys["acme"], OVER_CONTEXT)
    assert (status, out["error"]["code"]) == (503, "service_unavailable") and int(headers["retry-after"]) >= 1
