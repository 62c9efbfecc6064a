"""A key's resolved tenant, grants and quotas are kept in the web process (``serving.access_cache``),
and every change still acts on the very next request (issue 23, the serving path), over HTTP.

Each test first uses the key twice, the second time with no key lookup (the entry is warm), then
changes something from outside the server's threads, then sends the next request. The changes are
made the ways that bypass any Python hook: a bulk ``update()`` and raw SQL, as another process or an
operator's SQL would; the database triggers of ``serving.access_generation`` are what makes the
server see them. ``test_without_the_triggers_a_warm_entry_would_still_be_served`` shows that these
tests fail when that invalidation is gone.

The requests need no worker: ``OVER_CONTEXT`` is admitted and then refused by the view's exact check
(400 ``context_length_exceeded``), which proves it got through authentication, the grant and the quotas.
"""

from __future__ import annotations

import pytest

from tests.serving import admission_helpers
from tests.serving.admission_helpers import MODEL, err, post

keys, server_url = admission_helpers.keys, admission_helpers.server_url  # the fixtures, by name
OVER_CONTEXT = {"model": MODEL, "prompt": "hello", "max_tokens": 1020}


@pytest.fixture
def lookups(monkeypatch):
    """Every key lookup (``tenant_authenticate``) the server makes."""
    from controlplane.tenants import selectors

    seen: list[str] = []
    real = selectors.tenant_authenticate
    monkeypatch.setattr(selectors, "tenant_authenticate", lambda key: seen.append(key) or real(key))
    return seen


def admitted(url: str, key: str) -> None:
    err(post(url, key, "/v1/completions", OVER_CONTEXT), 400, "context_length_exceeded")


def warm(url: str, key: str, lookups: list[str]) -> None:
    """The key used twice: the second request is served from the access cache (no lookup)."""
    admitted(url, key)
    lookups.clear()
    admitted(url, key)
    assert lookups == [], "the second request should not have looked its key up"


def _sql(statement: str, params: list) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def test_a_revoked_key_is_refused_on_the_very_next_request_with_its_entry_warm(server_url, keys, lookups):
    from django.utils import timezone

    from controlplane.tenants.models import ApiKey

    warm(server_url, keys["acme"], lookups)
    _sql(f"UPDATE {ApiKey._meta.db_table} SET revoked_at = %s WHERE tenant_id = %s",
         [timezone.now(), keys["tenant"].pk])
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 401, "invalid_api_key")


def test_a_key_revoked_by_the_service_is_refused_at_once_and_another_key_keeps_working(server_url, keys, actor,
                                                                                      lookups):
    """Paired: the revocation refuses that key only; the tenant's other key, warm too, is still admitted."""
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.services import api_key_create, api_key_revoke

    first = ApiKey.objects.get(tenant=keys["tenant"])
    second = api_key_create(actor=actor, tenant=keys["tenant"])[1]
    warm(server_url, keys["acme"], lookups)
    warm(server_url, second, lookups)
    api_key_revoke(actor=actor, api_key=first)
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 401, "invalid_api_key")
    admitted(server_url, second)


def test_a_suspended_tenant_is_refused_on_the_very_next_request_with_its_entry_warm(server_url, keys, lookups):
    from controlplane.tenants.models import Tenant

    warm(server_url, keys["acme"], lookups)
    # the status alone, in bulk (no signal, no service): ``tenant_update`` would also reach every replica
    Tenant.objects.filter(pk=keys["tenant"].pk).update(status=Tenant.Status.SUSPENDED)
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 403, "tenant_suspended")
    Tenant.objects.filter(pk=keys["tenant"].pk).update(status=Tenant.Status.ACTIVE)
    admitted(server_url, keys["acme"])  # and back at once


def test_a_withdrawn_grant_is_a_404_on_the_very_next_request_with_its_entry_warm(server_url, keys, actor, lookups):
    from controlplane.registry.models import ModelDeployment
    from controlplane.tenants.access import grant_delete

    warm(server_url, keys["acme"], lookups)
    grant_delete(actor=actor, tenant=keys["tenant"], deployment=ModelDeployment.objects.get(name=MODEL))
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 404, "model_not_found")


def test_a_lowered_quota_applies_on_the_very_next_request_with_its_entry_warm(server_url, keys, lookups):
    from controlplane.tenants.models import Tenant

    warm(server_url, keys["acme"], lookups)
    _sql(f"UPDATE {Tenant._meta.db_table} SET max_prompt_tokens = %s WHERE id = %s", [2, keys["tenant"].pk])
    resp = post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT)
    assert resp.status_code == 413, resp.text


def test_without_the_triggers_a_warm_entry_would_still_be_served(server_url, keys, lookups):
    """What the tests above guard against: with the access-generation triggers dropped, a key revoked
    behind the server's back is still admitted from its warm entry. The triggers are put back after."""
    from django.db import connection
    from django.utils import timezone

    from controlplane.serving import access_generation
    from controlplane.tenants.models import ApiKey

    warm(server_url, keys["acme"], lookups)
    access_generation.uninstall(connection)
    try:
        _sql(f"UPDATE {ApiKey._meta.db_table} SET revoked_at = %s WHERE tenant_id = %s",
             [timezone.now(), keys["tenant"].pk])
        admitted(server_url, keys["acme"])  # stale: the cache is what the triggers keep honest
    finally:
        access_generation.install(connection)
    _sql(f"UPDATE {ApiKey._meta.db_table} SET last_used = NULL WHERE tenant_id = %s", [keys["tenant"].pk])
    admitted(server_url, keys["acme"])  # marking used moves nothing: the entry is still the stale one
    _sql(f"UPDATE {ApiKey._meta.db_table} SET revoked_at = revoked_at WHERE tenant_id = %s", [keys["tenant"].pk])
    err(post(server_url, keys["acme"], "/v1/completions", OVER_CONTEXT), 401, "invalid_api_key")
