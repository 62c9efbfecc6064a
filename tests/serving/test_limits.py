"""Request bodies over the limit are refused at the ASGI layer, before Django buffers anything:
from the declared Content-Length without reading the body, and for chunked bodies as soon as the
byte count passes the limit (the rest is never read)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from controlplane.common.asgi_limits import BodyLimit, declared_length

MiB = 2**20


# ---------------------------------------------------------------------------------------- unit
class _App:
    """A Django-like ASGI app: reads the whole body first, then answers 200 with its length."""

    def __init__(self) -> None:
        self.called = False
        self.messages: list[dict] = []

    async def __call__(self, scope, receive, send):
        self.called = True
        size = 0
        while True:
            message = await receive()
            self.messages.append(message)
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})


def _run(app, scope_headers, chunks, limit=250):
    pulled = []
    sent: list[dict] = []

    async def receive():
        i = len(pulled)
        pulled.append(i)
        if i >= len(chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[i], "more_body": i < len(chunks) - 1}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": scope_headers}
    asyncio.run(BodyLimit(app, limit_for=lambda path: limit)(scope, receive, send))
    return pulled, sent


def _status(sent):
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"])


def test_declared_length_over_limit_is_413_without_reading_or_calling_the_app():
    app = _App()
    pulled, sent = _run(app, [(b"content-length", b"100000")], [b"x" * 10])
    status, headers = _status(sent)
    assert status == 413 and headers[b"connection"] == b"close"
    assert pulled == [] and not app.called
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] and body["error"]["message"]


def test_undeclared_body_is_cut_off_once_the_count_passes_the_limit():
    app = _App()
    pulled, sent = _run(app, [(b"transfer-encoding", b"chunked")], [b"x" * 100] * 50)
    assert len(pulled) == 3  # 300 bytes > 250: nothing after the third chunk is read
    assert app.messages[-1] == {"type": "http.disconnect"}  # the app is told to stop reading
    assert _status(sent)[0] == 413
    assert len([m for m in sent if m["type"] == "http.response.start"]) == 1  # the app's answer is dropped


def test_bodies_within_the_limit_pass_unchanged():
    app = _App()
    pulled, sent = _run(app, [(b"content-length", b"250")], [b"x" * 125, b"y" * 125])
    assert _status(sent)[0] == 200 and sent[-1]["body"] == b"250"
    assert [m["body"] for m in app.messages] == [b"x" * 125, b"y" * 125]


def test_malformed_content_length_is_400():
    app = _App()
    _, sent = _run(app, [(b"content-length", b"12abc")], [b"{}"])
    assert _status(sent)[0] == 400 and not app.called
    assert declared_length([(b"content-length", b"5"), (b"Content-Length", b"5")]) == 5
    with pytest.raises(ValueError):
        declared_length([(b"content-length", b"5"), (b"content-length", b"6")])


def test_non_http_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    async def nothing():
        return {}

    asyncio.run(BodyLimit(app, limit_for=lambda path: 0)({"type": "lifespan"}, nothing, nothing))
    assert seen == ["lifespan"]


# ---------------------------------------------------------------------------------------- over HTTP
def _raw_post(url: str, path: str, declared: int, body: bytes, timeout: float = 10.0) -> tuple[int, dict, float]:
    """POST with a declared Content-Length but only ``body`` sent; returns (status, json, seconds)."""
    parts = urlsplit(url)
    t0 = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode() + body)
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < _length(raw):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload[: _length(raw)]), time.monotonic() - t0


def _length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


@pytest.mark.parametrize("path", ["/v1/completions", "/api/admin/tenants", "/admin/login/"])
def test_declared_64_mib_body_is_413_at_once_without_sending_it(asgi_url, path):
    """The server answers while the client has sent 2 of the 64 MiB it announced: nothing waited for them."""
    status, body, seconds = _raw_post(asgi_url, path, 64 * MiB, b"{}")
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large" and body["error"]["message"]
    assert seconds < 5
    assert httpx.get(f"{asgi_url}/healthz", timeout=10).status_code == 200


def test_chunked_body_is_cut_off_after_the_limit_not_read_to_the_end(asgi_url, settings):
    """A chunked body (no Content-Length) of 128 MiB with a 1 MiB limit: 413, and the server stopped
    reading long before the client's generator ran out, so it never held more than the limit."""
    settings.STRATA_MAX_BODY_BYTES = MiB
    total, yielded = 128, []

    def chunks():
        for i in range(total):
            yielded.append(i)
            yield b"x" * MiB

    resp = httpx.post(f"{asgi_url}/v1/completions", content=chunks(), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text[:200]
    assert resp.json()["error"]["code"] == "request_too_large"
    # socket buffers on both sides hold a few MiB; a server reading to the end would take all 128
    assert len(yielded) < total // 2, len(yielded)
    assert httpx.get(f"{asgi_url}/healthz", timeout=10).status_code == 200


def test_body_within_the_limit_still_reaches_the_view(asgi_url, settings):
    """Paired with the above: a chunked body under the limit is read whole (a 401 from the view, not 413)."""
    settings.STRATA_MAX_BODY_BYTES = MiB

    def chunks():
        for _ in range(4):
            yield b" " * (MiB // 8)
        yield b"{}"

    resp = httpx.post(f"{asgi_url}/v1/completions", content=chunks(), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 401, resp.text[:200]
