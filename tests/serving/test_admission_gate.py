"""Requests counted and refused before their bodies are read (issue 17, item 1), over HTTP: a request
counts against ``requests_per_minute`` whatever happens to it later, a tenant out of requests or
announcing a body over its limit is refused without the server reading the body (``serving.gate``).
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.serving import admission_helpers
from tests.serving.admission_helpers import MODEL, err, post

keys, server_url = admission_helpers.keys, admission_helpers.server_url  # the fixtures, by name


def test_refused_requests_count_against_requests_per_minute(server_url, keys, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"requests_per_minute": 2})
    huge = {"model": MODEL, "prompt": "x" * 100_000}
    err(post(server_url, keys["acme"], "/v1/completions", huge), 413, "prompt_too_long")
    err(post(server_url, keys["acme"], "/v1/chat/completions", b"{not json"), 400, "invalid_json")
    # the third request in the minute is refused before its body is looked at, whatever it holds
    err(post(server_url, keys["acme"], "/v1/completions", huge), 429, "rate_limit_requests")
    err(post(server_url, keys["acme"], "/v1/kv/lookup", {"model": MODEL, "tokens": [1] * 2000}), 429,
         "rate_limit_requests")


def test_bodies_over_the_paths_limit_count_too_so_a_flood_of_them_turns_into_429(server_url, keys, actor):
    """The 33 MB chat of the issue: refused unread with 413 and counted, so the third is a 429."""
    from django.conf import settings

    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"requests_per_minute": 2})
    over = settings.STRATA_SERVING_MAX_BODY_BYTES + 1
    codes = [_headers_only(server_url, keys["acme"], over, "/v1/chat/completions")[:2] for _ in range(3)]
    assert [status for status, _ in codes] == [413, 413, 429]
    assert codes[2][1]["error"]["code"] == "rate_limit_requests"


def _headers_only(url: str, key: str, declared: int, path: str = "/v1/completions") -> tuple[int, dict, str]:
    """POST announcing ``declared`` body bytes but sending none; (status, JSON, Retry-After)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode())
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)  # a server waiting for the body never answers: the timeout fails the test
            if not chunk:
                break
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    retry = next((v.strip() for n, _, v in (x.partition(":") for x in lines[1:]) if n.lower() == "retry-after"), "")
    return int(lines[0].split(" ", 2)[1]), json.loads(payload), retry


def test_a_tenant_out_of_requests_is_refused_before_its_body_is_read(server_url, keys, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"requests_per_minute": 2})
    for _ in range(2):
        err(post(server_url, keys["acme"], "/v1/completions", b"[]"), 400, "invalid_json")
    status, body, retry = _headers_only(server_url, keys["acme"], 4000)  # a body its limits would allow
    assert status == 429 and body["error"]["code"] == "rate_limit_requests" and int(retry) >= 1


def test_the_gate_lets_a_tenant_with_requests_left_through_to_the_view(server_url, keys):
    """Paired with the above: with requests left the body is awaited and read (a 400 for its content)."""
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {keys['acme']}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n".encode())
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):  # nothing is answered before the body came
            sock.recv(65536)
        sock.settimeout(30)
        sock.sendall(b"[]")
        assert b" 400 " in sock.recv(65536).split(b"\r\n", 1)[0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/kv/lookup", "/v1/kv/store",
                                  "/v1/responses"])
def test_a_body_announced_over_the_tenants_limit_is_413_before_it_is_read(server_url, keys, path):
    from controlplane.serving.admission import body_limit_for
    from controlplane.serving.gate import SMALL_BODY

    limit = body_limit_for(path, keys["tenant"])
    assert limit < 1024 * 1024  # far under the path's own limit, what the tiny model can need
    status, body, _ = _headers_only(server_url, keys["acme"], max(limit, SMALL_BODY) + 1, path)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"{limit} bytes" in body["error"]["message"]


def test_a_database_that_fails_during_admission_is_a_retryable_json_503(server_url, keys, monkeypatch):
    """A dead backend behind the gate is a 503 with Retry-After in the JSON error shape, never a bare 500."""
    from django.db import OperationalError

    from controlplane.serving import admission

    def down(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(admission, "admit", down)
    resp = post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    err(resp, 503, "service_unavailable")
    assert int(resp.headers["Retry-After"]) >= 1


def test_a_key_revoked_while_its_429_is_remembered_is_401_once_the_short_memory_ends(server_url, keys, actor):
    """The gate remembers a 429 only briefly (``RequestGate.REMEMBER_S``): revoking the key of a tenant
    that is out of requests makes it 401 within that time, not at the end of the minute."""
    import time

    from controlplane.serving.gate import RequestGate
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.services import api_key_revoke, tenant_update

    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"requests_per_minute": 1})
    err(post(server_url, keys["acme"], "/v1/completions", b"[]"), 400, "invalid_json")
    err(post(server_url, keys["acme"], "/v1/completions", b"[]"), 429, "rate_limit_requests")  # remembered
    api_key_revoke(actor=actor, api_key=ApiKey.objects.get(tenant=keys["tenant"]))
    time.sleep(RequestGate.REMEMBER_S + 0.2)  # past the memory: not a timing assertion
    err(post(server_url, keys["acme"], "/v1/completions", b"[]"), 401, "invalid_api_key")
