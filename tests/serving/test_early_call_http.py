"""A whole (non-streamed) completion's worker call starts on its preparation thread (``EarlyCall``):
over HTTP against a real worker, the call is submitted from a serving database thread, answered once
and released; a streamed request keeps the event loop's own call."""

from __future__ import annotations

import threading

import httpx
import pytest

from controlplane.runtime import gateway


@pytest.fixture
def submits(monkeypatch):
    """Each ``gateway.submit`` the server makes: (thread name, whether it started a call)."""
    seen: list[tuple[str, bool]] = []
    real = gateway.submit

    def submit(*args, **kwargs):
        started = real(*args, **kwargs)
        seen.append((threading.current_thread().name, started is not None))
        return started

    monkeypatch.setattr(gateway, "submit", submit)
    return seen


def _post(platform, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.url}{path}", json={"model": platform.model, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"})


def test_whole_completions_start_their_worker_call_on_the_preparation_thread(platform, submits):
    first = _post(platform, "/v1/completions", {"prompt": "early call " * 4, "max_tokens": 3, "temperature": 0})
    assert first.status_code == 200, first.text  # the replica's handle is now known
    submits.clear()
    again = _post(platform, "/v1/completions", {"prompt": "early call " * 4, "max_tokens": 3, "temperature": 0})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    chat = _post(platform, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert len(submits) == 2 and all(name.startswith("strata-serving-db") and ok for name, ok in submits), submits

    submits.clear()
    with httpx.stream("POST", f"{platform.url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                      json={"model": platform.model, "prompt": "streamed", "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    assert submits == []  # a stream's call is the event loop's

    rs = gateway.replica_set(gateway.spec_for(platform.deployment))
    assert all(rs.describe(i)["inflight"] == 0 for i in rs.indices())
