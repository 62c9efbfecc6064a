"""Shared by the admission tests (``test_admission_bounds``, ``test_admission_gate``): a real uvicorn
serving the ASGI app in a thread of this process (no worker: every request there is refused before
one would be called), tenant ``acme`` with its key, and the calls the server makes to the tokenizer,
the chat template and the schema, recorded."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from cachecore.model.tokenizer import ByteTokenizer, ChatTemplate

MODEL = "tiny-bounds"  # tiny preset: context 1,024 tokens, byte tokenizer (one character = one token at least)


@pytest.fixture(scope="module")
def server_url(django_db_setup, django_db_blocker):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config("controlplane.asgi:application", host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def keys(server_url, transactional_db, actor):
    """Tenant ``acme`` (max_prompt_tokens 256, 2 requests a minute when a test says so) and its key."""
    from django.core.cache import caches

    from controlplane.registry.services import model_create
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    caches["limits"].clear()  # rate-limit windows of earlier tests (tenant ids are reused after a flush)
    deployment = model_create(actor=actor, name=MODEL, preset="tiny", revision={"label": "r1", "seed": 5})
    tenant = tenant_create(actor=actor, slug="acme", name="Acme", quotas={"max_prompt_tokens": 256})
    grant_create(actor=actor, tenant=tenant, deployment=deployment)
    return {"acme": api_key_create(actor=actor, tenant=tenant)[1], "tenant": tenant}


def post(url: str, key: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def err(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert error["code"] == code, error
    return error["message"]


@pytest.fixture
def calls(monkeypatch):
    """Every call the server makes to the byte tokenizer's ``encode``, the ChatML template's ``render``
    and the schema validation, by name."""
    from controlplane.serving import intake

    seen: list[str] = []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ByteTokenizer, "encode", record("encode", ByteTokenizer.encode))
    monkeypatch.setattr(ChatTemplate, "render", record("render", ChatTemplate.render))
    monkeypatch.setattr(intake, "validate", record("validate", intake.validate))
    return seen
