"""Paired isolation through HTTP: a tenant reuses its own prefix and never sees another's."""

from __future__ import annotations

import pytest

PREFIX = "Confidential board minutes of the acquisition, page one. " * 5


@pytest.fixture
def platform(engine_platform):
    """Every test here runs on both engines (``engine_platform``)."""
    return engine_platform


def _cached(platform, tenant: str, prompt: str, **extra) -> int:
    out = platform.client(tenant).completions.create(model=platform.model, prompt=prompt, max_tokens=1,
                                                     temperature=0, extra_body=extra or None)
    return out.usage.prompt_tokens_details.cached_tokens


def test_tenant_b_never_hits_tenant_a_prefix(platform):
    assert _cached(platform, "acme", PREFIX + "A") == 0
    assert _cached(platform, "acme", PREFIX + "A") > 0  # paired: A does reuse its own prefix
    assert _cached(platform, "globex", PREFIX + "A") == 0
    assert _cached(platform, "globex", PREFIX + "A") > 0  # B's own second request hits B's entry


def test_client_cannot_widen_scope_with_fields(platform):
    _cached(platform, "acme", PREFIX + "W")
    # a client naming another tenant, user or salt gets no access to acme's namespace
    assert _cached(platform, "globex", PREFIX + "W", user="acme") == 0
    assert _cached(platform, "initech", PREFIX + "W", cache_salt="acme") == 0


def test_share_group_members_share_and_outsiders_do_not(platform, actor):
    from controlplane.tenants.access import share_group_add, share_group_create

    group = share_group_create(actor=actor, slug="partners", name="Partners")
    share_group_add(actor=actor, group=group, tenant=platform.tenants["acme"])
    share_group_add(actor=actor, group=group, tenant=platform.tenants["globex"])
    assert _cached(platform, "acme", PREFIX + "S") == 0
    assert _cached(platform, "globex", PREFIX + "S") > 0
    assert _cached(platform, "initech", PREFIX + "S") == 0


def test_cache_salt_narrows_within_a_tenant(platform):
    assert _cached(platform, "acme", PREFIX + "N", cache_salt="user-1") == 0
    assert _cached(platform, "acme", PREFIX + "N", cache_salt="user-1") > 0
    assert _cached(platform, "acme", PREFIX + "N", cache_salt="user-2") == 0
    assert _cached(platform, "acme", PREFIX + "N") == 0
