"""Named caches over HTTP (``/v1/caches``) with the official openai client, on both engines: prewarm,
use by prefix and by ``cache_id``, scope isolation, the pin quota, TTL changes and deletion from every
tier, audited."""

from __future__ import annotations

import time

import httpx
import pytest

DOC = "Strata named cache document: the attention KV of this text is prefilled once. " * 5


@pytest.fixture
def platform(engine_platform):
    return engine_platform


def _h(platform, tenant):
    return {"Authorization": f"Bearer {platform.keys[tenant]}"}


def _create(platform, tenant="acme", **body):
    return httpx.post(f"{platform.url}/v1/caches", headers=_h(platform, tenant), timeout=300,
                      json={"model": platform.model, **body})


def _pin_quota(platform, tenant, tokens):
    from controlplane.tenants.models import Tenant

    Tenant.objects.filter(slug=tenant).update(max_pinned_tokens=tokens)


def test_prewarm_then_a_request_with_the_prefix_hits_and_output_is_exact(platform):
    _pin_quota(platform, "acme", 100_000)
    r = _create(platform, prompt=DOC, ttl_seconds=600, display_name="manual", cache_salt="nc-1")
    assert r.status_code == 201, r.text
    cache = r.json()
    assert cache["id"].startswith("cache_") and cache["model"] == platform.model
    bs = platform.block_size
    assert cache["pinned_tokens"] == cache["tokens"] // bs * bs > 0
    assert cache["tiers"]["l2"] >= cache["tokens"] // bs * bs  # committed to L2 before the answer
    assert cache["expires_at"] - time.time() == pytest.approx(600, abs=30)
    client = platform.client("acme")
    hit = client.completions.create(model=platform.model, prompt=DOC + " Q?", max_tokens=6, temperature=0,
                                    extra_body={"cache_salt": "nc-1"})
    assert hit.usage.prompt_tokens_details.cached_tokens >= cache["tokens"] // bs * bs
    cold = client.completions.create(model=platform.model, prompt=DOC + " Q?", max_tokens=6, temperature=0,
                                     extra_body={"cache_salt": "nc-cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].text == cold.choices[0].text
    # by cache_id: the server prepends the cached tokens
    by_id = client.completions.create(model=platform.model, prompt=" Q?", max_tokens=6, temperature=0,
                                      extra_body={"cache_id": cache["id"], "cache_salt": "nc-1"})
    assert by_id.usage.prompt_tokens == hit.usage.prompt_tokens
    assert by_id.usage.prompt_tokens_details.cached_tokens >= cache["tokens"] // bs * bs
    assert by_id.choices[0].text == cold.choices[0].text
    listed = httpx.get(f"{platform.url}/v1/caches", headers=_h(platform, "acme"), timeout=30).json()
    assert [c["id"] for c in listed["data"]] == [cache["id"]]


def test_another_tenants_cache_is_a_404_like_a_missing_one(platform):
    cache = _create(platform, prompt=DOC).json()
    missing = "cache_" + "0" * 24
    for cid in (cache["id"], missing):
        for method in ("GET", "PATCH", "DELETE"):
            r = httpx.request(method, f"{platform.url}/v1/caches/{cid}", headers=_h(platform, "globex"),
                              json={"ttl_seconds": 120} if method == "PATCH" else None, timeout=60)
            assert r.status_code == 404, (method, r.text)
            assert r.json()["error"]["code"] == "cache_not_found"
    r = httpx.post(f"{platform.url}/v1/completions", headers=_h(platform, "globex"), timeout=60,
                   json={"model": platform.model, "prompt": "x", "max_tokens": 1, "cache_id": cache["id"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "cache_not_found"
    assert httpx.get(f"{platform.url}/v1/caches", headers=_h(platform, "globex"), timeout=30).json()["data"] == []
    # still there for its owner
    assert httpx.get(f"{platform.url}/v1/caches/{cache['id']}", headers=_h(platform, "acme"),
                     timeout=30).status_code == 200


def test_pins_are_bounded_by_the_quota_and_default_to_none(platform):
    unpinned = _create(platform, prompt=DOC).json()
    assert unpinned["pinned_tokens"] == 0  # max_pinned_tokens defaults to 0
    bs = platform.block_size
    full = unpinned["tokens"] // bs * bs
    _pin_quota(platform, "acme", full)
    first = _create(platform, prompt=DOC + "one").json()
    assert first["pinned_tokens"] == full
    second = _create(platform, prompt=DOC + "two").json()
    assert second["pinned_tokens"] == 0  # no quota left: created, not pinned


def test_ttl_extend_shorten_and_bad_input(platform):
    cache = _create(platform, prompt=DOC, ttl_seconds=300).json()
    url = f"{platform.url}/v1/caches/{cache['id']}"
    r = httpx.patch(url, headers=_h(platform, "acme"), json={"ttl_seconds": 3000}, timeout=60)
    assert r.status_code == 200 and r.json()["expires_at"] - time.time() == pytest.approx(3000, abs=30)
    r = httpx.patch(url, headers=_h(platform, "acme"), json={"ttl_seconds": 120}, timeout=60)
    assert r.json()["expires_at"] - time.time() == pytest.approx(120, abs=30)
    for bad in ({"ttl_seconds": 1}, {"ttl_seconds": "x"}, {"ttl": 5}, {"ttl_seconds": 10**9}):
        r = httpx.patch(url, headers=_h(platform, "acme"), json=bad, timeout=60)
        assert r.status_code == 422, (bad, r.text)
    for bad in ({}, {"prompt": DOC, "messages": [{"role": "user", "content": "x"}]}, {"prompt": ""},
                {"prompt": DOC, "ttl_seconds": 0}):
        r = _create(platform, **bad)
        assert r.status_code == 422, (bad, r.text)
    r = httpx.post(f"{platform.url}/v1/caches", headers=_h(platform, "acme"), json={"model": "nope", "prompt": "x"},
                   timeout=60)
    assert r.status_code == 404
    assert httpx.get(f"{platform.url}/v1/caches", timeout=30).status_code == 401


def test_delete_removes_the_bytes_from_every_tier_and_is_audited(platform):
    from controlplane.audit.models import AuditEvent

    _pin_quota(platform, "acme", 100_000)
    cache = _create(platform, prompt=DOC + "to delete", cache_salt="nc-del").json()
    r = httpx.delete(f"{platform.url}/v1/caches/{cache['id']}", headers=_h(platform, "acme"), timeout=120)
    assert r.status_code == 200 and r.json()["deleted"] is True
    client = platform.client("acme")
    after = client.completions.create(model=platform.model, prompt=DOC + "to delete", max_tokens=1,
                                      temperature=0, extra_body={"cache_salt": "nc-del", "cache_diagnostics": True})
    by_tier = after.usage.prompt_tokens_details.cached_tokens_by_tier
    assert by_tier["l2"] == 0 and by_tier["l3"] == 0  # gone from Strata's host pool and remote tier
    if platform.engine == "strata":
        assert after.usage.prompt_tokens_details.cached_tokens == 0  # and from the device pages
        lost = after.model_extra["cache_diagnostics"]["lost"][0]
        assert lost["reason"] == "deleted" and lost["cache"] == cache["id"]
    assert httpx.get(f"{platform.url}/v1/caches/{cache['id']}", headers=_h(platform, "acme"),
                     timeout=30).status_code == 404
    actions = list(AuditEvent.objects.filter(target=cache["id"]).order_by("seq").values_list("action", flat=True))
    assert actions == ["cache.create", "cache.delete"]
    prefix = platform.keys["acme"][:8]
    for ev in AuditEvent.objects.filter(target=cache["id"]):
        assert ev.new_value["key_prefix"] and prefix.startswith(ev.new_value["key_prefix"][:6])


def test_chat_named_cache_used_by_cache_id(platform):
    system = [{"role": "system", "content": "You are a terse assistant for Strata. " * 6}]
    r = _create(platform, messages=system, cache_salt="nc-chat")
    assert r.status_code == 201, r.text
    cache = r.json()
    client = platform.client("acme")
    question = [{"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model=platform.model, messages=system + question, max_tokens=4,
                                          temperature=0, extra_body={"cache_salt": "nc-chat-cold"})
    by_id = client.chat.completions.create(model=platform.model, messages=question, max_tokens=4, temperature=0,
                                           extra_body={"cache_id": cache["id"], "cache_salt": "nc-chat"})
    assert by_id.usage.prompt_tokens == full.usage.prompt_tokens
    assert by_id.usage.prompt_tokens_details.cached_tokens > 0
    assert by_id.choices[0].message.content == full.choices[0].message.content
    wrong = httpx.post(f"{platform.url}/v1/completions", headers=_h(platform, "acme"), timeout=60,
                       json={"model": platform.model, "prompt": "x", "max_tokens": 1, "cache_id": cache["id"]})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "cache_kind_mismatch"
