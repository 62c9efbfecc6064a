"""Cache accounting in every response's usage and "why did this miss", over HTTP with the official
openai client, on both engines."""

from __future__ import annotations

import httpx
import pytest

SYSTEM = "You answer questions about the Strata cache platform, briefly and exactly. " * 4


@pytest.fixture
def platform(engine_platform):
    return engine_platform


@pytest.fixture
def strata(asgi_url, transactional_db, actor):
    """The platform on Strata's engine alone: for tests of the web process's own bookkeeping."""
    from controlplane.registry.services import model_create
    from tests.serving.conftest import MODEL, _platform

    deployment = model_create(actor=actor, name=MODEL, preset="tiny", revision={"label": "r1", "seed": 5})
    return _platform(asgi_url, actor, deployment)


def _details(resp) -> dict:
    return resp.usage.prompt_tokens_details.model_dump()


def test_usage_carries_write_tokens_and_cached_tokens_by_tier(platform):
    client = platform.client("acme")
    prompt = SYSTEM + "Q: what is L1?"
    first = client.completions.create(model=platform.model, prompt=prompt, max_tokens=2, temperature=0)
    d1 = _details(first)
    bs = platform.block_size
    assert d1["cached_tokens"] == 0
    assert d1["cache_write_tokens"] == first.usage.prompt_tokens // bs * bs > 0
    assert d1["cached_tokens_by_tier"] == {"l1": 0, "l2": 0, "l3": 0}
    second = client.completions.create(model=platform.model, prompt=prompt, max_tokens=2, temperature=0)
    d2 = _details(second)
    assert d2["cached_tokens"] > 0
    assert sum(d2["cached_tokens_by_tier"].values()) == d2["cached_tokens"]
    assert d2["cache_write_tokens"] == 0  # nothing new: every full block was cached already
    assert "replica" not in d2 and "load_stop" not in d2  # the worker's internal fields never leak


def _diagnose(platform, tenant: str, prompt, **extra) -> dict:
    r = httpx.post(f"{platform.url}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                   json={"model": platform.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                         "cache_diagnostics": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_diagnostics_name_no_prior_request_divergence_and_below_block(platform):
    bs = platform.block_size
    first = _diagnose(platform, "acme", SYSTEM + "first question? " * 12, cache_salt="diag-1")
    diag = first["cache_diagnostics"]
    n = first["usage"]["prompt_tokens"]
    usable = (n - 1) // bs * bs
    assert diag["cached_tokens"] == 0 and diag["reusable_tokens"] == 0
    assert [s["reason"] for s in diag["lost"]] == ["no_prior_request", "below_block"]
    assert diag["lost"][0] == {"start": 0, "end": usable, "tokens": usable, "reason": "no_prior_request"}
    assert diag["lost"][1]["end"] == n
    # The same system prompt, another question: reused up to its last shared full block, and the
    # rest diverged at the exact token where the two prompts differ.
    second = _diagnose(platform, "acme", SYSTEM + "other question? " * 12, cache_salt="diag-1")
    d2 = second["cache_diagnostics"]
    reasons = {s["reason"]: s for s in d2["lost"]}
    assert "diverged_at" in reasons, d2
    ids1 = httpx.post(f"{platform.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                      json={"model": platform.model, "prompt": SYSTEM + "first question? " * 12, "max_tokens": 1,
                            "cache_salt": "diag-1"}).json()["usage"]["prompt_tokens"]
    assert ids1 == n
    if platform.engine == "strata":  # byte tokenizer: token i is byte i-1 (after BOS)
        expected = 1 + len(SYSTEM)
        assert reasons["diverged_at"]["index"] == expected
    assert d2["cached_tokens"] == reasons["diverged_at"]["index"] // bs * bs
    assert d2["cached_tokens"] > 0


def test_another_tenants_many_salts_never_wipe_a_tenants_history(strata, monkeypatch):
    """Issue 42 item 5: globex sends more distinct ``cache_salt`` values than the history's scope cap
    (shrunk here from 256 to 4); acme's next miss still knows its prompt: a divergence, never
    ``no_prior_request``. The flood costs globex its own oldest scopes only."""
    from controlplane.caches import history

    monkeypatch.setattr(history.HISTORY, "max_scopes", 4)
    _diagnose(strata, "acme", SYSTEM + "the first question?", cache_salt="victim")
    for i in range(10):
        _diagnose(strata, "globex", "x", cache_salt=f"flood-{i}")
    history.HISTORY.check_integrity()
    d = _diagnose(strata, "acme", SYSTEM + "another question?", cache_salt="victim")["cache_diagnostics"]
    assert d["cached_tokens"] > 0
    reasons = [s["reason"] for s in d["lost"]]
    assert "diverged_at" in reasons and "no_prior_request" not in reasons, d
    # globex's newest salts are remembered, its oldest are not: the cap binds the flooding tenant
    kept = _diagnose(strata, "globex", "xyz" * 20, cache_salt="flood-9")["cache_diagnostics"]
    assert kept["lost"][0]["reason"] == "diverged_at" and kept["lost"][0]["index"] == 2
    gone = _diagnose(strata, "globex", "xyz" * 20, cache_salt="flood-0")["cache_diagnostics"]
    assert gone["lost"][0]["reason"] == "no_prior_request"


def _chat_diagnosis(platform, tenant: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(f"{platform.url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                   json={"model": platform.model, "messages": messages, "max_tokens": 1, "temperature": 0,
                         "cache_diagnostics": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["cache_diagnostics"]


def test_a_long_chats_diagnosis_renders_few_prefixes_and_says_when_truncated(strata, monkeypatch):
    """Issue 42 item 9: naming the message where a 100-message chat diverged renders at most
    ceil(log2(100)) = 7 of its prefixes (every prefix was 99, the square of the chat in work), none
    when there is nothing to name; past ``MAX_PART_RENDERS`` the answer names no message and says
    ``diagnostics_truncated``."""
    from cachecore.model.tokenizer import ChatTemplate
    from controlplane.caches import diagnostics

    renders = []
    real = ChatTemplate.render

    def spy(self, messages, add_generation_prompt=True, budget=None):
        if not add_generation_prompt:  # a prefix for the diagnosis, not the prompt itself
            renders.append(len(messages))
        return real(self, messages, add_generation_prompt, budget)

    monkeypatch.setattr(ChatTemplate, "render", spy)
    messages = [{"role": "user", "content": chr(97 + i % 26)} for i in range(100)]  # 9 tokens each
    first = _chat_diagnosis(strata, "acme", messages, cache_salt="long-chat")
    assert [s["reason"] for s in first["lost"]] == ["no_prior_request", "below_block"]
    assert renders == []  # nothing diverged: nothing to name, nothing rendered
    changed = [*messages[:70], {"role": "user", "content": "!"}, *messages[71:]]
    d = _chat_diagnosis(strata, "acme", changed, cache_salt="long-chat")
    span = d["lost"][0]
    assert span["reason"] == "diverged_at" and span["index"] == 1 + 70 * 9 + 6  # BOS, 70 messages, "<s>user\n"
    assert span["part"] == "messages[70]" and "diagnostics_truncated" not in d
    assert 0 < len(renders) <= 7
    renders.clear()
    monkeypatch.setattr(diagnostics, "MAX_PART_RENDERS", 3)
    again = [*messages[:40], {"role": "user", "content": "?"}, *messages[41:]]
    d = _chat_diagnosis(strata, "acme", again, cache_salt="long-chat")
    span = d["lost"][0]
    assert span["reason"] == "diverged_at" and span["index"] == 1 + 40 * 9 + 6
    assert "part" not in span and d["diagnostics_truncated"] is True
    assert len(renders) == 3


def test_diagnostics_never_speak_of_another_tenants_cache(platform):
    prompt = SYSTEM + "globex's secret question"
    for _ in range(2):  # globex has it cached
        warm = _diagnose(platform, "globex", prompt)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    probe = _diagnose(platform, "initech", prompt)["cache_diagnostics"]
    assert probe["cached_tokens"] == 0
    assert probe["lost"][0]["reason"] == "no_prior_request"
    assert probe["reusable_tokens"] == 0


def test_diagnostics_by_header_and_in_the_stream(platform):
    headers = {"Authorization": f"Bearer {platform.keys['acme']}", "X-Strata-Cache-Diagnostics": "1"}
    body = {"model": platform.model, "prompt": SYSTEM + "streamed", "max_tokens": 2, "temperature": 0,
            "stream": True, "cache_salt": "diag-stream"}
    with httpx.stream("POST", f"{platform.url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json

    found = [json.loads(line[6:]) for line in lines if "cache_diagnostics" in line]
    assert len(found) == 1
    assert found[0]["cache_diagnostics"]["lost"][0]["reason"] == "no_prior_request"
    plain = httpx.post(f"{platform.url}/v1/completions", headers={"Authorization": headers["Authorization"]},
                       json={**body, "stream": False}, timeout=120).json()
    assert "cache_diagnostics" not in plain  # only when asked


def test_the_ledger_totals_equal_the_sum_of_the_responses_usage(platform):
    """An operator can bill from the ledger: over the period, its totals for the tenant and model are
    the sums of what every response's usage said (completions, chats, streams and a prewarm)."""
    from django.utils import timezone

    from controlplane.ledger.selectors import ledger_totals

    tenant = platform.tenants["initech"]
    since = timezone.now().replace(minute=0, second=0, microsecond=0)
    client = platform.client("initech")
    usages = []
    for i in range(3):
        r = client.completions.create(model=platform.model, prompt=SYSTEM + f"bill {i % 2}", max_tokens=3,
                                      temperature=0)
        usages.append(r.usage.model_dump())
    chat = client.chat.completions.create(model=platform.model, messages=[{"role": "user", "content": SYSTEM}],
                                          max_tokens=2, temperature=0)
    usages.append(chat.usage.model_dump())
    stream = client.completions.create(model=platform.model, prompt=SYSTEM + "bill 0", max_tokens=2, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usages += [c.usage.model_dump() for c in stream if c.usage is not None]
    assert len(usages) == 5
    total = ledger_totals(tenant=tenant, model=platform.model, since=since)
    want = {
        "requests": len(usages),
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "completion_tokens": sum(u["completion_tokens"] for u in usages),
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
        "write_tokens": sum(u["prompt_tokens_details"]["cache_write_tokens"] for u in usages),
        **{f"cached_{t}": sum(u["prompt_tokens_details"]["cached_tokens_by_tier"][t] for u in usages)
           for t in ("l1", "l2", "l3")},
    }
    assert {k: total.counts[k] for k in want} == want
    assert want["cached_tokens"] > 0 and want["write_tokens"] > 0
    # every prompt token not reused is accounted for by one miss reason
    assert sum(total.misses.values()) == want["prompt_tokens"] - want["cached_tokens"]
