"""The miss diagnostics' history and reasons (``caches.history``, ``caches.diagnostics``), without a
worker: a usage dict stands in for the worker's account of each request."""

from __future__ import annotations

import pytest

from controlplane.caches import diagnostics, history

BS = 4


def _req(tokens, *, cached=0, tenant="1", salt=b"s" * 32, revision="r1", stop=None, replica="rep-0",
         persist=True, retention=3600, parts=None):
    usage = {"cached_tokens": cached, "load_stop": stop, "replica": replica}
    return diagnostics.Request(tenant=tenant, tenant_salt=salt, model="m", cache_salt=None, tokens=list(tokens),
                               block_size=BS, revision=revision, persist=persist, retention_seconds=retention,
                               usage=usage, parts=parts)


@pytest.fixture
def h():
    return history.PrefixHistory()


def _reasons(d):
    return [(s["reason"], s["start"], s["end"]) for s in d["lost"]]


def test_no_prior_then_divergence_inside_a_block_and_inside_the_tail(h):
    a = list(range(1, 15))  # 3 full blocks + 2
    d = diagnostics.diagnose(_req(a), history=h, now=100.0)
    assert _reasons(d) == [("no_prior_request", 0, 12), ("below_block", 12, 14)]
    b = a[:6] + [99] + a[7:]  # differs at token 6 (block 1)
    d = diagnostics.diagnose(_req(b, cached=4), history=h, now=101.0)
    assert d["lost"][0] == {"start": 4, "end": 12, "reason": "diverged_at", "index": 6, "tokens": 8}
    # the first prompt's partial tail is remembered too: a prompt going on past it diverges after it
    c = a + [7, 7, 7, 7, 7]
    d = diagnostics.diagnose(_req(c, cached=12), history=h, now=102.0)
    assert d["lost"][0]["reason"] == "diverged_at" and d["lost"][0]["index"] == 14


def test_seen_but_lost_reasons_in_order(h):
    a = list(range(1, 18))
    diagnostics.diagnose(_req(a), history=h, now=100.0)
    assert _reasons(diagnostics.diagnose(_req(a, revision="r2"), history=h, record=False, now=101.0))[0][0] == \
        "revision_changed"
    d = diagnostics.diagnose(_req(a), history=h, record=False, now=101.0, flushes=lambda since: "42")
    assert d["lost"][0]["reason"] == "flushed" and d["lost"][0]["job"] == "42"
    for stop, reason in (("corrupt", "load_failed"), ("late", "too_slow_to_load"), ("recompute", "too_slow_to_load")):
        d = diagnostics.diagnose(_req(a, stop=stop), history=h, record=False, now=101.0)
        assert d["lost"][0]["reason"] == reason
    d = diagnostics.diagnose(_req(a, retention=10), history=h, record=False, now=200.0)
    assert d["lost"][0]["reason"] == "expired"
    d = diagnostics.diagnose(_req(a, persist=False, replica="rep-1"), history=h, record=False, now=101.0)
    assert d["lost"][0]["reason"] == "evicted"  # recorded with persist=True: L3 is shared
    d = diagnostics.diagnose(_req(a, cached=8), history=h, record=False, now=101.0)
    assert d["lost"][0] == {"start": 8, "end": 16, "reason": "evicted", "tiers": ["l1", "l2", "l3"],
                            "after": d["lost"][0]["after"], "tokens": 8}
    assert d["reusable_tokens"] == 16
    key = history.scope_key(b"s" * 32, "m", None)
    h.mark_deleted(("1", "m", ""), history.digests(key, a, BS), "cache_x")
    d = diagnostics.diagnose(_req(a), history=h, record=False, now=101.0)
    assert d["lost"][0]["reason"] == "deleted" and d["lost"][0]["cache"] == "cache_x"


def test_routed_elsewhere_when_not_persisted(h):
    a = list(range(1, 18))
    diagnostics.diagnose(_req(a, persist=False, replica="rep-0"), history=h, now=100.0)
    d = diagnostics.diagnose(_req(a, persist=False, replica="rep-1"), history=h, record=False, now=101.0)
    assert d["lost"][0]["reason"] == "routed_elsewhere"


def test_another_tenants_prompt_is_never_seen(h):
    a = list(range(1, 18))
    diagnostics.diagnose(_req(a, tenant="1", salt=b"a" * 32), history=h, now=100.0)
    d = diagnostics.diagnose(_req(a, tenant="2", salt=b"b" * 32), history=h, now=101.0)
    assert d["lost"][0]["reason"] == "no_prior_request" and d["reusable_tokens"] == 0
    # even with the same tenant id, another key: nothing in common
    d = diagnostics.diagnose(_req(a, tenant="1", salt=b"c" * 32), history=h, record=False, now=101.0)
    assert d["lost"][0]["reason"] == "no_prior_request"


def _chat(messages: list[list[int]], roles: list[str] | None = None, max_renders: int | None = None):
    """A chat whose message ``i`` renders to ``messages[i]``'s ids, and its ``ChatParts``."""
    tokens = [t for m in messages for t in m]
    roles = roles or ["user"] * len(messages)
    extra = {} if max_renders is None else {"max_renders": max_renders}
    return tokens, diagnostics.ChatParts(tokens, roles, lambda k: [t for m in messages[:k] for t in m], **extra)


def test_chat_part_names_the_message(h):
    sys_ = list(range(1, 9))
    diagnostics.diagnose(_req(sys_ + [50, 51, 52, 53, 54]), history=h, now=100.0)
    tokens, parts = _chat([sys_, [60, 61, 62, 63, 64]], roles=["system", "user"])
    d = diagnostics.diagnose(_req(tokens, cached=8, parts=parts), history=h, now=101.0)
    assert d["lost"][0]["reason"] == "diverged_at" and d["lost"][0]["part"] == "messages[1]"
    assert "diagnostics_truncated" not in d


def test_a_long_chats_part_is_found_in_a_logarithmic_number_of_renders():
    """Naming the message of a divergence in a 2,040-message chat renders 11 prefixes, not 2,039."""
    from cachecore.model.tokenizer import ChatTemplate

    chat = ChatTemplate()
    messages = [{"role": "user", "content": f"message {i}"} for i in range(2040)]
    tokens = chat.render(messages)
    rendered = []

    def render(k):
        rendered.append(k)
        return chat.render(messages[:k], add_generation_prompt=False)

    def part_at(index):
        rendered.clear()
        parts = diagnostics.ChatParts(tokens, [m["role"] for m in messages], render)
        name = parts.part_at(index)
        assert len(rendered) == len(set(rendered)) <= 11 and not parts.truncated  # ceil(log2(2040))
        return name

    for i in (0, 1, 777, 2039):
        start = len(chat.render(messages[:i], add_generation_prompt=False)) if i else 0
        assert part_at(start) == part_at(start + 3) == f"messages[{i}]"
        if i:
            assert part_at(start - 1) == f"messages[{i - 1}]"


def test_a_chat_past_its_render_budget_names_no_part_and_says_truncated(h):
    messages = [[i + 1] * 4 for i in range(300)]  # one full block per message
    first, _ = _chat(messages)
    diagnostics.diagnose(_req(first), history=h, now=100.0)
    changed = [m[:] for m in messages]
    changed[200][2] = 999
    tokens, parts = _chat(changed, max_renders=3)
    d = diagnostics.diagnose(_req(tokens, cached=800, parts=parts), history=h, record=False, now=101.0)
    assert d["lost"][0]["reason"] == "diverged_at" and d["lost"][0]["index"] == 802
    assert "part" not in d["lost"][0] and d["diagnostics_truncated"] is True
    assert parts.renders == 3
    # within its budget the same chat names the message
    tokens, parts = _chat(changed)
    d = diagnostics.diagnose(_req(tokens, cached=800, parts=parts), history=h, record=False, now=101.0)
    assert d["lost"][0]["part"] == "messages[200]" and "diagnostics_truncated" not in d
    assert parts.renders <= 9  # ceil(log2(300))


def test_a_template_that_is_not_prefix_stable_names_no_part(h):
    """A prefix that renders differently from the start of the prompt is never trusted."""
    messages = [[i + 1] * 4 for i in range(8)]
    tokens = [t for m in messages for t in m]
    parts = diagnostics.ChatParts(tokens, ["user"] * 8, lambda k: [0] + [t for m in messages[:k] for t in m])
    assert parts.part_at(20) is None and not parts.truncated
    broken = diagnostics.ChatParts(tokens, ["user"] * 8, lambda k: 1 / 0)
    assert broken.part_at(20) is None


def _salted(tokens, *, tenant="1", salt=None, cached=0):
    req = _req(tokens, tenant=tenant, salt=tenant.encode() * 32, cached=cached)
    return diagnostics.Request(**{**req.__dict__, "cache_salt": salt})


def test_the_history_is_bounded_and_holds_no_tokens(h):
    small = history.PrefixHistory(max_blocks=10, max_scopes=2, max_tenant_blocks=15, max_tenants=3)
    for i in range(20):
        diagnostics.diagnose(_req([i * 100 + j for j in range(1, 14)]), history=small, now=float(i))
    assert small.tenants() == {"1": (1, 10)}
    for i in range(6):  # three scopes of four blocks: the tenant keeps two scopes, at most 15 digests
        diagnostics.diagnose(_salted(list(range(1, 17)), salt=str(i % 3)), history=small, now=1.0)
        small.check_integrity()
    assert small.tenants()["1"] == (2, 8)
    for t in range(5):
        diagnostics.diagnose(_req(list(range(1, 10)), tenant=str(t)), history=small, now=1.0)
        small.check_integrity()
    assert list(small.tenants()) == ["2", "3", "4"]  # the least recently used tenants out first
    small.forget_tenant("3")
    assert list(small.tenants()) == ["2", "4"]
    small.check_integrity()
    tokens = list(range(1000, 1013))
    diagnostics.diagnose(_req(tokens, tenant="z"), history=h, now=1.0)
    blob = b"".join(s.masks + d for t in h._tenants.values() for sc in t.scopes.values() for d, s in sc.blocks.items())
    import array

    assert array.array("I", tokens[:4]).tobytes() not in blob


def test_one_tenants_many_scopes_never_evict_another_tenants_history():
    """Issue 42 item 5: tenant 2 records more distinct ``cache_salt`` scopes than any cap; tenant 1's
    prompt is still seen, so its next miss is a divergence, not ``no_prior_request``."""
    small = history.PrefixHistory(max_scopes=4, max_tenants=8)
    victim = list(range(1, 14))
    diagnostics.diagnose(_salted(victim), history=small, now=1.0)
    for i in range(50):
        diagnostics.diagnose(_salted([7], tenant="2", salt=f"flood-{i}"), history=small, now=2.0)
    small.check_integrity()
    assert small.tenants() == {"1": (1, 4), "2": (4, 4)}  # three blocks and a tail; four one-token tails
    d = diagnostics.diagnose(_salted(victim[:6] + [99] * 7, cached=4), history=small, now=3.0)
    assert d["lost"][0]["reason"] == "diverged_at" and d["lost"][0]["index"] == 6
    # and the flooding tenant's own oldest scopes did go: its first salt is a stranger again
    d = diagnostics.diagnose(_salted(list(range(1, 10)), tenant="2", salt="flood-0"), history=small, now=4.0)
    assert d["lost"][0]["reason"] == "no_prior_request"


@pytest.mark.django_db
def test_offboarding_drops_the_tenants_history_share(actor):
    """An offboarded tenant's share leaves this process's history at once (it would otherwise hold
    one of the ``max_tenants`` places until it aged out)."""
    from controlplane.tenants.services import tenant_create, tenant_offboard

    tenant = tenant_create(actor=actor, slug="leaving", name="Leaving")
    diagnostics.diagnose(_salted(list(range(1, 14)), tenant=str(tenant.pk)), now=1.0)
    assert str(tenant.pk) in history.HISTORY.tenants()
    tenant_offboard(actor=actor, tenant=tenant, reason="test")
    assert str(tenant.pk) not in history.HISTORY.tenants()
