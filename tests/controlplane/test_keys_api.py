"""Tenant API keys: shown once, stored hashed, listed by prefix, revoked at once."""

import json

import pytest

from tests.controlplane.helpers import assert_error, post

pytestmark = pytest.mark.django_db
KEYS = "/api/admin/tenants/acme/keys"


def test_key_is_returned_once_with_prefix_and_authenticates(admin_client, tenant):
    from controlplane.tenants.selectors import tenant_authenticate

    response = post(admin_client, KEYS, {"name": "ci"})
    assert response.status_code == 201
    body = response.json()
    assert set(body) >= {"id", "key", "prefix"}
    assert body["key"].startswith("sk-st-") and body["key"].startswith(body["prefix"])
    assert len(body["prefix"]) == 14
    result = tenant_authenticate(body["key"])
    assert result is not None and result.ok and result.tenant.slug == "acme"


def test_key_never_appears_in_list_database_or_audit(admin_client, tenant):
    from controlplane.audit.models import AuditEvent
    from controlplane.tenants.models import ApiKey

    raw = post(admin_client, KEYS, {}).json()["key"]
    listing = admin_client.get(KEYS)
    assert listing.status_code == 200
    (item,) = listing.json()
    assert item["prefix"] == raw[:14] and "key" not in item and "key_hash" not in item
    assert raw not in listing.content.decode()
    stored = ApiKey.objects.get()
    assert raw not in {stored.prefix, stored.key_hash, stored.name}
    audit_text = json.dumps(list(AuditEvent.objects.values()), default=str)
    assert raw not in audit_text and stored.key_hash not in audit_text
    assert stored.prefix in audit_text  # keys are audited by prefix


def test_two_keys_differ_and_each_only_matches_itself(admin_client, tenant):
    from controlplane.tenants.selectors import tenant_authenticate

    one = post(admin_client, KEYS, {}).json()
    two = post(admin_client, KEYS, {}).json()
    assert one["key"] != two["key"]
    assert tenant_authenticate(one["key"]).api_key.pk == one["id"]
    assert tenant_authenticate(two["key"]).api_key.pk == two["id"]


def test_revoked_key_fails_at_once_while_other_keys_still_work(admin_client, tenant):
    from controlplane.tenants.selectors import tenant_authenticate

    doomed = post(admin_client, KEYS, {}).json()
    kept = post(admin_client, KEYS, {}).json()
    response = admin_client.delete(f"{KEYS}/{doomed['id']}")
    assert response.status_code == 200 and response.json()["revoked_at"] is not None
    revoked = tenant_authenticate(doomed["key"])
    assert revoked is not None and not revoked.ok and revoked.status == "revoked"
    assert tenant_authenticate(kept["key"]).ok


def test_unknown_or_tampered_key_is_none(admin_client, tenant):
    from controlplane.tenants.selectors import tenant_authenticate

    raw = post(admin_client, KEYS, {}).json()["key"]
    assert tenant_authenticate(raw[:-1] + ("A" if raw[-1] != "A" else "B")) is None
    assert tenant_authenticate("sk-st-doesnotexist") is None
    assert tenant_authenticate("") is None
    assert tenant_authenticate(raw) is not None


def test_suspended_tenant_key_reports_suspended_and_reactivation_restores(admin_client, tenant, actor):
    from controlplane.tenants.selectors import tenant_authenticate
    from controlplane.tenants.services import tenant_update

    raw = post(admin_client, KEYS, {}).json()["key"]
    tenant_update(actor=actor, tenant=tenant, status="suspended")
    assert tenant_authenticate(raw).status == "suspended"
    tenant_update(actor=actor, tenant=tenant, status="active")
    assert tenant_authenticate(raw).status == "active"


def test_authentication_compares_digests_in_constant_time(admin_client, tenant, monkeypatch):
    from controlplane.common import tokens
    from controlplane.tenants.selectors import tenant_authenticate

    raw = post(admin_client, KEYS, {}).json()["key"]
    calls = []
    real = tokens.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", spy)
    assert tenant_authenticate(raw).ok
    assert tenant_authenticate("sk-st-unknownprefix") is None  # no candidate: still one compare
    assert len(calls) == 2
    assert all(len(a) == len(b) == 64 for a, b in calls)  # digests, never the raw key


def test_revoking_another_tenants_key_is_404(admin_client, tenant, actor):
    from controlplane.tenants.services import api_key_create, tenant_create

    other = tenant_create(actor=actor, slug="other", name="Other")
    key, _ = api_key_create(actor=actor, tenant=other)
    assert_error(admin_client.delete(f"{KEYS}/{key.pk}"), 404, "key_not_found")
    key.refresh_from_db()
    assert key.revoked_at is None


def test_revoking_twice_is_idempotent(admin_client, tenant):
    from tests.controlplane.helpers import audit_actions

    key_id = post(admin_client, KEYS, {}).json()["id"]
    first = admin_client.delete(f"{KEYS}/{key_id}").json()
    second = admin_client.delete(f"{KEYS}/{key_id}").json()
    assert first["revoked_at"] == second["revoked_at"]
    assert audit_actions().count("key.revoke") == 1


def test_non_integer_key_id_is_422(admin_client, tenant):
    assert_error(admin_client.delete(f"{KEYS}/abc"), 422)


def test_mark_used_writes_at_most_once_per_minute(admin_client, tenant):
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.services import api_key_mark_used

    post(admin_client, KEYS, {})
    key = ApiKey.objects.get()
    api_key_mark_used(api_key=key)
    first = ApiKey.objects.get().last_used
    api_key_mark_used(api_key=key)
    assert first is not None and ApiKey.objects.get().last_used == first
