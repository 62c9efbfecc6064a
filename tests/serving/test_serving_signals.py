"""``controlplane.asgi.ServingASGIHandler``: Django's per-request signals of a request the gate let
through (``request_started``, and ``request_finished`` from ``response.close``) run on the event loop
when every receiver is one of Django's own (``LOOP_SAFE_RECEIVERS``), with no thread hop; any other
receiver still gets them the Django way, on a thread (``test_admission_once``: on a lane); a request
the gate did not let through keeps Django's own handling."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import threading
import time

import httpx
import pytest

from tests.serving import admission_helpers
from tests.serving.admission_helpers import err, post
from tests.serving.test_admission_once import OVER_CONTEXT

keys, server_url = admission_helpers.keys, admission_helpers.server_url  # the fixtures, by name


def test_the_web_process_hands_the_gil_on_sooner_than_pythons_default():
    """Importing the ASGI entry sets the process's GIL switch interval (``GIL_SWITCH_INTERVAL_S``), under
    Python's 5 ms, so that the event loop is not left waiting on a thread's Python work."""
    import sys

    from controlplane import asgi

    assert asgi.GIL_SWITCH_INTERVAL_S < 0.005
    assert sys.getswitchinterval() == pytest.approx(asgi.GIL_SWITCH_INTERVAL_S)


def test_the_handler_follows_the_installed_djangos_handle():
    """``ServingASGIHandler.handle`` is Django's ``ASGIHandler.handle`` with its signal steps changed:
    a Django upgrade that changes that method must be looked at (and the hash updated)."""
    from django.core.handlers.asgi import ASGIHandler

    from controlplane import asgi

    source = inspect.getsource(ASGIHandler.handle).encode()
    assert hashlib.sha256(source).hexdigest() == asgi.DJANGO_HANDLE_SOURCE_SHA256


@pytest.fixture
def recorded(monkeypatch):
    """Where a receiver of both signals ran: (thread name, on an event loop), one per signal sent."""
    from django.core.signals import request_finished, request_started

    from controlplane import asgi

    seen: list[tuple[str, bool]] = []

    def record(**kwargs):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((threading.current_thread().name, on_loop))

    monkeypatch.setattr(asgi, "LOOP_SAFE_RECEIVERS", asgi.LOOP_SAFE_RECEIVERS | {record})
    request_started.connect(record, dispatch_uid="loop-test-started")
    request_finished.connect(record, dispatch_uid="loop-test-finished")
    try:
        yield seen
    finally:
        request_started.disconnect(dispatch_uid="loop-test-started")
        request_finished.disconnect(dispatch_uid="loop-test-finished")


def _both(seen: list) -> list:
    deadline = time.monotonic() + 10  # request_finished runs after the response was sent
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(seen)


def test_signals_of_a_gated_request_run_on_the_event_loop_without_a_hop(server_url, keys, recorded):
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 400, "context_length_exceeded")
    steps = _both(recorded)
    assert len(steps) == 2 and all(on_loop for _, on_loop in steps), steps
    recorded.clear()
    # not let through by the gate (no bearer-key POST): Django's own thread for the request
    assert httpx.get(f"{server_url}/v1/models", headers={"Authorization": f"Bearer {keys['acme']}"},
                     timeout=60).status_code == 200
    steps = _both(recorded)
    assert len(steps) == 2 and not any(on_loop for _, on_loop in steps), steps


def test_a_request_the_gate_refused_after_reading_its_body_still_closes_on_the_loop(server_url, keys, recorded):
    """A deferred admission refused in the view (a revoked key: 401) is answered and closed the same way."""
    from controlplane.common.actor import Actor
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.services import api_key_revoke

    key = ApiKey.objects.get(tenant=keys["tenant"])
    api_key_revoke(actor=Actor.system("test"), api_key=key)
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 401, "invalid_api_key")
    steps = _both(recorded)
    assert len(steps) == 2 and all(on_loop for _, on_loop in steps), steps
