"""Anthropic's Messages API (``POST /v1/messages``) over HTTP with the official ``anthropic`` client
against the real server (uvicorn, a local Ray worker of the tiny preset): whole and streamed answers,
``cache_control`` breakpoints soft-pinned within ``max_pinned_tokens`` (read back on the next call even
after the tenant's own traffic evicted its unpinned blocks; gone after their TTL), both ways to present
the key, and every error in Anthropic's shape."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

SYSTEM = "You are the Strata cache assistant. Tenants never share KV cache entries with each other. " * 4
QUESTION = "Which tier holds a pinned prefix?"
EVICT_MODEL = "tiny-messages-evict"
REVISION = {"label": "r1", "seed": 5}


def _client(platform, tenant="acme", **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=platform.url, api_key=platform.keys[tenant], max_retries=0, timeout=120, **kw)


def _system(ttl: str | None = "5m", text: str = SYSTEM) -> list[dict]:
    block = {"type": "text", "text": text}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return [block]


def _create(platform, tenant="acme", *, model=None, system=None, question=QUESTION, **kw):
    return _client(platform, tenant).messages.create(
        model=model or platform.model, max_tokens=kw.pop("max_tokens", 8),
        extra_body={"temperature": 0, **kw.pop("extra_body", {})},
        system=system if system is not None else _system(),
        messages=[{"role": "user", "content": question}], **kw)


def _pin_quota(tenant: str, tokens: int, **fields) -> None:
    from controlplane.tenants.models import Tenant

    Tenant.objects.filter(slug=tenant).update(max_pinned_tokens=tokens, **fields)


def _post(platform, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/messages", json=body, timeout=120,
                      headers={"anthropic-version": "2023-06-01", **(headers or {})})


def _key(platform, tenant="acme") -> dict:
    return {"x-api-key": platform.keys[tenant]}


def test_create_answers_a_message_the_client_parses(platform):
    msg = _create(platform, system=SYSTEM, max_tokens=6)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == platform.model
    assert msg.content[0].type == "text" and isinstance(msg.content[0].text, str)
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 6 and msg.usage.input_tokens > 0
    # the same prompt through chat completions gives the same text: one path underneath
    chat = platform.client("acme").chat.completions.create(
        model=platform.model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == msg.content[0].text
    assert chat.usage.prompt_tokens == (msg.usage.input_tokens + msg.usage.cache_read_input_tokens
                                        + msg.usage.cache_creation_input_tokens)


def test_breakpoint_is_created_then_read_and_the_counts_add_up(platform):
    _pin_quota("acme", 100_000)
    first = _create(platform, question="First question about tiers?")
    u1 = first.usage
    bs = platform.block_size
    assert u1.cache_creation_input_tokens > 0 and u1.cache_read_input_tokens == 0
    assert u1.cache_creation.ephemeral_5m_input_tokens == u1.cache_creation_input_tokens
    [bp] = u1.model_extra["cache_breakpoints"]
    assert bp["status"] == "pinned" and bp["pinned_tokens"] == bp["tokens"] // bs * bs > len(SYSTEM) // 2
    second = _create(platform, question="A different question, same system?")
    u2 = second.usage
    assert u2.cache_read_input_tokens >= bp["pinned_tokens"] and u2.cache_creation_input_tokens == 0
    total1 = u1.input_tokens + u1.cache_read_input_tokens + u1.cache_creation_input_tokens
    total2 = u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens
    assert total2 - total1 == len("A different question, same system?") - len("First question about tiers?")
    # the pin is a named cache of kind "prefix", extended (not duplicated) by the second call
    listed = httpx.get(f"{platform.url}/v1/caches", headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                       timeout=30).json()["data"]
    assert [(c["kind"], c["pinned_tokens"]) for c in listed] == [("prefix", bp["pinned_tokens"])]
    from controlplane.audit.models import AuditEvent

    [created] = AuditEvent.objects.filter(action="cache.create", target=listed[0]["id"])
    assert created.new_value["kind"] == "prefix" and created.tenant == "acme"


def test_streaming_sends_anthropics_events_and_the_final_usage(platform):
    _pin_quota("acme", 100_000)
    with _client(platform).messages.stream(model=platform.model, max_tokens=8, extra_body={"temperature": 0},
                                           system=_system(),
                                           messages=[{"role": "user", "content": "Stream it?"}]) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert "text" in kinds or "content_block_delta" in kinds
    whole = _create(platform, question="Stream it?")
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.cache_creation_input_tokens > 0  # the first call with this breakpoint pinned it
    assert whole.usage.cache_read_input_tokens >= final.usage.cache_creation_input_tokens
    # a raw stream carries SSE event lines
    r = httpx.post(f"{platform.url}/v1/messages", headers=_key(platform), timeout=60,
                   json={"model": platform.model, "max_tokens": 3, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_top_level_cache_control_marks_the_last_block_and_max_tokens_0_only_fills_the_cache(platform):
    _pin_quota("acme", 100_000)
    question = "A long user question that is worth caching on its own. " * 4
    warm = _client(platform).messages.create(model=platform.model, max_tokens=0, system=SYSTEM,
                                             cache_control={"type": "ephemeral", "ttl": "1h"},
                                             messages=[{"role": "user", "content": question}])
    assert warm.content == [] and warm.usage.output_tokens == 0 and warm.stop_reason == "max_tokens"
    [bp] = warm.usage.model_extra["cache_breakpoints"]
    assert bp["ttl"] == "1h" and bp["status"] == "pinned"
    assert bp["tokens"] > len(SYSTEM) + len(question)  # the whole system and user turns
    assert warm.usage.cache_creation.ephemeral_1h_input_tokens == warm.usage.cache_creation_input_tokens > 0
    hit = _create(platform, system=SYSTEM, question=question)
    assert hit.usage.cache_read_input_tokens >= bp["pinned_tokens"]


def test_stop_sequences_end_the_text_and_are_named(platform):
    free = _create(platform, system=SYSTEM, max_tokens=12).content[0].text
    assert len(free) >= 4
    stop = free[2:4]
    msg = _create(platform, system=SYSTEM, max_tokens=12, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == free[:free.index(stop)]


def test_x_api_key_and_bearer_are_the_same_key_and_a_wrong_one_is_401(platform):
    body = {"model": platform.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
    assert _post(platform, body, _key(platform)).status_code == 200
    bearer = anthropic.Anthropic(base_url=platform.url, auth_token=platform.keys["acme"], max_retries=0)
    assert bearer.messages.create(model=platform.model, max_tokens=2,
                                  messages=[{"role": "user", "content": "hello"}]).usage.output_tokens == 2
    wrong = "sk-st-" + "A" * 43
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=platform.url, api_key=wrong, max_retries=0).messages.create(
            model=platform.model, max_tokens=2, messages=[{"role": "user", "content": "hello"}])
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
    missing = _post(platform, body)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    # x-api-key is honoured on this route only: elsewhere the key must come as a bearer
    r = httpx.post(f"{platform.url}/v1/chat/completions", headers=_key(platform), timeout=30,
                   json={"model": platform.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401


def test_bad_keys_from_one_source_are_locked_out_in_anthropics_shape(platform):
    from django.core.cache import caches

    from controlplane.serving import keyguard

    body = {"model": platform.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    try:
        statuses = [_post(platform, body, {"x-api-key": f"sk-st-bad{i}"}).status_code
                    for i in range(keyguard.FAILURE_LIMIT + 1)]
        assert statuses[0] == 401 and statuses[-1] == 429
        locked = _post(platform, body, {"x-api-key": "nonsense"})
        assert locked.status_code == 429 and locked.json()["error"]["type"] == "rate_limit_error"
        assert _post(platform, body, _key(platform)).status_code == 200  # a valid key is never refused
    finally:
        caches["lockouts"].clear()  # the lock on this test client's address would outlive the test


def test_requests_per_minute_refusal_is_a_rate_limit_error(platform):
    from django.core.cache import caches

    from controlplane.tenants.models import Tenant

    Tenant.objects.filter(slug="initech").update(requests_per_minute=1)
    body = {"model": platform.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    try:
        assert _post(platform, body, _key(platform, "initech")).status_code == 200
        with pytest.raises(anthropic.RateLimitError) as caught:
            _client(platform, "initech").messages.create(**body)
        assert caught.value.body["error"]["type"] == "rate_limit_error"
        assert caught.value.response.headers.get("retry-after")
    finally:
        caches["limits"].clear()  # this minute's window, for the tenants of later tests


def test_five_breakpoints_are_a_400_like_anthropics(platform):
    cc = {"type": "ephemeral"}
    content = [{"type": "text", "text": f"part {i}", "cache_control": cc} for i in range(4)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        _client(platform).messages.create(model=platform.model, max_tokens=1, system=_system(),
                                          messages=[{"role": "user", "content": content}])
    err = caught.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "maximum of 4" in err["error"]["message"]
    ok = _client(platform).messages.create(model=platform.model, max_tokens=1, system=_system(None),
                                           messages=[{"role": "user", "content": content}])
    assert len(ok.usage.model_extra["cache_breakpoints"]) == 4


@pytest.mark.parametrize("body, status, kind", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),  # no max_tokens
    ({"max_tokens": 1, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 1, "tools": [], "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 1, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 1, "system": [{"type": "text", "text": "s", "cache_control": {"type": "persistent"}}],
      "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ({"model": "no-such-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "invalid_request_error"),
])
def test_bad_input_is_an_anthropic_shaped_4xx(platform, body, status, kind):
    r = _post(platform, {"model": platform.model, **body}, _key(platform))
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


def test_bad_bytes_and_methods_are_anthropic_shaped(platform):
    r = httpx.post(f"{platform.url}/v1/messages", content=b"{not json", timeout=30,
                   headers={**_key(platform), "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{platform.url}/v1/messages", headers=_key(platform), timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"
    # refused by the gate before the body is read (over what the tenant's models can need)
    r = httpx.post(f"{platform.url}/v1/messages", content=b"{" + b" " * 1_000_000 + b"}", timeout=30,
                   headers={**_key(platform), "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert r.json()["type"] == "error"


def test_another_tenants_pins_are_never_visible(platform):
    _pin_quota("acme", 100_000)
    _pin_quota("globex", 100_000)
    assert _create(platform, "acme").usage.cache_creation_input_tokens > 0
    assert _create(platform, "acme").usage.cache_read_input_tokens > 0
    other = _create(platform, "globex").usage
    assert other.cache_read_input_tokens == 0 and other.cache_creation_input_tokens > 0
    listed = httpx.get(f"{platform.url}/v1/caches", headers={"Authorization": f"Bearer {platform.keys['initech']}"},
                       timeout=30).json()["data"]
    assert listed == []


def test_past_the_pin_budget_the_request_is_served_and_says_so(platform):
    _pin_quota("acme", 16)  # less than the system prompt's full blocks
    r = _post(platform, {"model": platform.model, "max_tokens": 4, "system": _system(),
                         "messages": [{"role": "user", "content": QUESTION}]}, _key(platform))
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert [b["status"] for b in usage["cache_breakpoints"]] == ["not_pinned"]
    assert usage["cache_creation_input_tokens"] == 0 and usage["output_tokens"] == 4
    assert r.headers["x-strata-cache-control"].startswith("not_pinned=1")
    _pin_quota("acme", 100_000)
    r = _post(platform, {"model": platform.model, "max_tokens": 4, "system": _system(),
                         "messages": [{"role": "user", "content": QUESTION}]}, _key(platform))
    assert r.headers["x-strata-cache-control"] == "pinned=1"


@pytest.fixture
def evictable(platform, actor):
    """A deployment whose worker holds 128 blocks (2,048 tokens) in L1 and has no L2; acme's KV is
    not persisted (no L3): what its own traffic evicts is gone unless pinned."""
    import ray

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name=EVICT_MODEL, preset="tiny", revision=dict(REVISION))
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=deployment)
    handle = worker_actor.launch(EVICT_MODEL, "tiny", dict(REVISION), l1_mb=1, l2_mb=0)
    assert ray.get(handle.info.remote())["num_blocks"] == 128
    _pin_quota("acme", 100_000, persist_kv=False)
    yield EVICT_MODEL
    gateway.forget(EVICT_MODEL)
    ray.kill(handle)


def _flood(platform, model: str) -> None:
    """The tenant's own traffic: 3,000 tokens of other prompts through a 2,048-token pool."""
    client = platform.client("acme")
    for i in range(5):
        client.completions.create(model=model, prompt=f"{i} flood " + "abcdefghij"[i] * 590, max_tokens=1,
                                  temperature=0)


def test_pinned_breakpoint_survives_evicting_traffic_and_an_unpinned_prefix_does_not(platform, evictable):
    other = "An unpinned system prompt of the same length, cached but not kept. " * 5
    plain = _create(platform, model=evictable, system=_system(None, other))
    pinned = _create(platform, model=evictable)
    assert pinned.usage.cache_creation_input_tokens > 0
    _flood(platform, evictable)
    again = _create(platform, model=evictable, question="Another question?")
    assert again.usage.cache_read_input_tokens >= pinned.usage.cache_creation_input_tokens
    plain_again = _create(platform, model=evictable, system=_system(None, other), question="Another question?")
    assert plain_again.usage.cache_read_input_tokens == 0
    assert plain.usage.cache_read_input_tokens == 0


def test_after_its_ttl_the_pin_is_gone(platform, evictable, settings):
    settings.STRATA_CACHE_CONTROL_TTL_SCALE = 0.005  # 5m -> 1.5 s
    first = _create(platform, model=evictable)
    [bp] = first.usage.model_extra["cache_breakpoints"]
    assert bp["status"] == "pinned" and first.usage.cache_creation_input_tokens > 0
    time.sleep(max(0.0, bp["expires_at"] + 1 - time.time()))
    _flood(platform, evictable)
    after = _create(platform, model=evictable, question="Another question?")
    assert after.usage.cache_read_input_tokens == 0
    assert after.usage.cache_creation_input_tokens == first.usage.cache_creation_input_tokens  # pinned anew


@pytest.fixture
def vllm_platform(asgi_url, transactional_db, actor, vllm_checkpoint):
    """The serving platform on vLLM (its CPU build): a random Llama checkpoint, 32-token blocks."""
    from controlplane.registry.services import model_create
    from tests.serving.conftest import VLLM_MODEL, _platform

    deployment = model_create(actor=actor, name=VLLM_MODEL, preset="",
                              revision={"label": "r1", "path": str(vllm_checkpoint[0])}, engine="vllm")
    return _platform(asgi_url, actor, deployment, engine="vllm", block_size=32)


@pytest.mark.slow
def test_on_vllm_breakpoints_are_read_back_streamed_and_bounded(vllm_platform):
    platform = vllm_platform
    _pin_quota("acme", 100_000)
    first = _create(platform)
    [bp] = first.usage.model_extra["cache_breakpoints"]
    assert bp["status"] == "pinned" and bp["pinned_tokens"] == bp["tokens"] // 32 * 32 > 0
    assert first.usage.cache_creation_input_tokens > 0
    second = _create(platform, question="Another question?")
    assert second.usage.cache_read_input_tokens >= bp["pinned_tokens"]
    assert second.usage.cache_creation_input_tokens == 0
    other = _create(platform, "globex").usage  # another tenant: nothing of acme's
    assert other.cache_read_input_tokens == 0
    with _client(platform).messages.stream(model=platform.model, max_tokens=6, extra_body={"temperature": 0},
                                           system=_system(), messages=[{"role": "user", "content": QUESTION}]
                                           ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == streamed == _create(platform, max_tokens=6).content[0].text
    assert final.usage.cache_read_input_tokens >= bp["pinned_tokens"] and final.usage.output_tokens == 6
    _pin_quota("initech", 0)
    r = _post(platform, {"model": platform.model, "max_tokens": 2, "system": _system(),
                         "messages": [{"role": "user", "content": QUESTION}]}, _key(platform, "initech"))
    assert r.status_code == 200 and r.headers["x-strata-cache-control"] == "not_pinned=1"
    cc = {"type": "ephemeral"}
    r = _post(platform, {"model": platform.model, "max_tokens": 1, "system": _system(), "messages": [
        {"role": "user", "content": [{"type": "text", "text": f"p{i}", "cache_control": cc} for i in range(4)]}]},
        _key(platform))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_conversation_reuses_the_breakpoint_on_its_last_turn_and_a_prefill_is_continued(platform):
    _pin_quota("acme", 100_000)
    cc = {"type": "ephemeral"}
    turns = [{"role": "user", "content": "Explain the tiers of the cache, one by one, in detail please. " * 3},
             {"role": "assistant", "content": "L1 holds device pages; L2 host memory; L3 a remote store. " * 3},
             {"role": "user", "content": [{"type": "text", "text": "And which tier keeps a pinned prefix? " * 3,
                                           "cache_control": cc}]}]
    client = _client(platform)
    first = client.messages.create(model=platform.model, max_tokens=4, system=SYSTEM, messages=turns,
                                   extra_body={"temperature": 0})
    [bp] = first.usage.model_extra["cache_breakpoints"]
    assert bp["status"] == "pinned" and bp["tokens"] > len(SYSTEM) + 3 * 150
    follow = [*turns, {"role": "assistant", "content": "L2."}, {"role": "user", "content": "Why?"}]
    nxt = client.messages.create(model=platform.model, max_tokens=4, system=SYSTEM, messages=follow,
                                 extra_body={"temperature": 0})
    assert nxt.usage.cache_read_input_tokens >= bp["pinned_tokens"]  # the whole previous turn's prefix
    # a final assistant message is continued: the same tokens as the chat path rendering it as a prefix
    prefill = client.messages.create(model=platform.model, max_tokens=4, system=SYSTEM, extra_body={"temperature": 0},
                                     messages=[*turns, {"role": "assistant", "content": "The answer is"}])
    prompt = (prefill.usage.input_tokens + prefill.usage.cache_read_input_tokens
              + prefill.usage.cache_creation_input_tokens)
    opened = (first.usage.input_tokens + first.usage.cache_read_input_tokens
              + first.usage.cache_creation_input_tokens)
    assert prompt == opened + len("The answer is")  # no end of turn, no new assistant header


def test_messages_are_booked_in_the_ledger_and_diagnosed_on_request(platform):
    from controlplane.ledger.models import LedgerHour
    from controlplane.serving import accountant

    _pin_quota("acme", 100_000)
    _create(platform, max_tokens=3)
    second = _create(platform, max_tokens=3, extra_body={"cache_diagnostics": True})
    assert "cache_diagnostics" in second.model_extra
    accountant.drain()
    row = LedgerHour.objects.get(tenant=platform.tenants["acme"], model=platform.model)
    assert row.requests == 2 and row.completion_tokens == 6
    assert row.cached_tokens == second.usage.cache_read_input_tokens > 0
