"""The named caches' calls (``/v1/caches``, ``/v1/caches/{id}``) go through the serving gate like a
completion (issue 42, item 6), over HTTP against the real server: an invalid key or a tenant out of
requests is refused before the body is read, each call counts once against ``requests_per_minute``,
a body announced over its limit is 413 unread, and a prewarm's body is parsed and its chat rendered in
the render pool."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from django.conf import settings

from cachecore.model.tokenizer import ChatTemplate
from tests.serving import admission_helpers
from tests.serving.admission_helpers import MODEL, err

keys, server_url = admission_helpers.keys, admission_helpers.server_url  # the fixtures, by name

ANNOUNCED = 4 * 1024 * 1024  # the body: within the serving API's limit, so only the gate refuses it


def _headers_only(url: str, key: str, declared: int, path: str = "/v1/caches", method: str = "POST"
                  ) -> tuple[int, dict, str]:
    """``method`` announcing ``declared`` body bytes but sending none; (status, JSON, Retry-After). A
    server that waits for the body never answers: the socket's timeout fails the test."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode())
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    retry = next((v.strip() for n, _, v in (x.partition(":") for x in lines[1:]) if n.lower() == "retry-after"), "")
    return int(lines[0].split(" ", 2)[1]), json.loads(payload), retry


def _get(url: str, key: str, path: str = "/v1/caches"):
    import httpx

    return httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/caches"), ("PATCH", "/v1/caches/cache_0123"),
                                              ("DELETE", "/v1/caches/cache_0123")])
def test_an_invalid_key_announcing_a_large_body_is_401_before_it_is_read(server_url, keys, method, path):
    assert ANNOUNCED <= settings.STRATA_SERVING_MAX_BODY_BYTES  # not refused for its size alone
    status, body, _ = _headers_only(server_url, "sk-not-a-key-" + "x" * 32, ANNOUNCED, path, method)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_a_tenant_out_of_requests_is_refused_before_its_cache_body_is_read(server_url, keys, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"requests_per_minute": 2})
    for _ in range(2):  # each call counts once: two in the minute are served
        r = _get(server_url, keys["acme"])
        assert r.status_code == 200 and r.json() == {"object": "list", "data": []}, r.text
    status, body, retry = _headers_only(server_url, keys["acme"], 4000)  # a body its limits would allow
    assert status == 429 and body["error"]["code"] == "rate_limit_requests" and int(retry) >= 1
    err(_get(server_url, keys["acme"]), 429, "rate_limit_requests")


def test_a_cache_call_with_requests_left_waits_for_its_body(server_url, keys):
    """Paired with the above: with requests left the body is awaited and read (a 400 for its content)."""
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/caches HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {keys['acme']}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n".encode())
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):  # nothing is answered before the body came
            sock.recv(65536)
        sock.settimeout(30)
        sock.sendall(b"[]")
        assert b" 400 " in sock.recv(65536).split(b"\r\n", 1)[0]


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/caches"), ("PATCH", "/v1/caches/cache_0123"),
                                              ("GET", "/v1/caches")])
def test_a_cache_body_announced_over_its_limit_is_413_before_it_is_read(server_url, keys, method, path):
    from controlplane.serving.admission import SMALL_JSON_BODY, body_limit_for

    limit = body_limit_for(path, keys["tenant"], method=method)
    assert limit == SMALL_JSON_BODY if method != "POST" else SMALL_JSON_BODY < limit < 1024 * 1024
    status, body, _ = _headers_only(server_url, keys["acme"], limit + 1, path, method)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"{limit} bytes" in body["error"]["message"]


@pytest.fixture
def threads(monkeypatch):
    """The threads the server decodes bodies and renders chat templates on, by step."""
    from controlplane.serving import intake

    seen: list[tuple[str, str]] = []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(intake, "decode_body", record("decode", intake.decode_body))
    monkeypatch.setattr(ChatTemplate, "render", record("render", ChatTemplate.render))
    return seen


def test_a_prewarms_body_is_parsed_and_its_chat_rendered_in_the_render_pool(server_url, keys, threads):
    """The chat renders past the tenant's ``max_prompt_tokens`` (256): refused with 413 once rendered,
    before any worker is called, so this server needs none."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "system", "content": "y" * 250}], "ttl_seconds": 600}
    r = httpx.post(f"{server_url}/v1/caches", json=body, headers={"Authorization": f"Bearer {keys['acme']}"},
                   timeout=60)
    err(r, 413, "prompt_too_long")
    assert [step for step, _ in threads] == ["decode", "render"]
    assert all(name.startswith("strata-render") for _, name in threads), threads
