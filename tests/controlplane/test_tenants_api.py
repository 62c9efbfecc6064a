"""Tenant CRUD through /api/admin/ with operator bearer tokens."""

import pytest

from tests.controlplane.helpers import assert_error, audit_actions, patch, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"


def test_admin_creates_tenant_201_and_reads_it_back(admin_client):
    created = post(admin_client, URL, {"slug": "acme", "name": "Acme", "quotas": {"requests_per_minute": 60}})
    assert created.status_code == 201
    body = created.json()
    assert body["slug"] == "acme" and body["status"] == "active"
    assert body["quotas"] == {"requests_per_minute": 60, "tokens_per_minute": None, "max_cached_tokens": None,
                              "max_prompt_tokens": None, "max_l3_bytes": None, "max_inflight_tokens": None,
                              "max_concurrent_requests": None, "share_weight": None,
                              "max_pinned_tokens": None, "max_adapters": None}
    assert len(body["scope_fingerprint"]) == 16
    fetched = admin_client.get(f"{URL}/acme")
    assert fetched.status_code == 200 and fetched.json() == body
    assert [t["slug"] for t in admin_client.get(URL).json()] == ["acme"]


def test_tenant_output_never_contains_the_salt(admin_client):
    from controlplane.tenants.models import Tenant

    body = post(admin_client, URL, {"slug": "acme", "name": "Acme"}).content
    salt = bytes(Tenant.objects.get(slug="acme").scope_salt)
    assert b"salt" not in body
    assert salt.hex().encode() not in body and salt.hex()[:16].encode() not in body


def test_each_tenant_gets_its_own_random_salt_and_fingerprint(admin_client):
    from controlplane.tenants.models import Tenant

    one = post(admin_client, URL, {"slug": "one", "name": "One"}).json()
    two = post(admin_client, URL, {"slug": "two", "name": "Two"}).json()
    salts = {bytes(t.scope_salt) for t in Tenant.objects.all()}
    assert len(salts) == 2 and all(len(s) == 32 for s in salts)
    assert one["scope_fingerprint"] != two["scope_fingerprint"]


def test_patch_changes_name_status_and_quotas_and_audits_each(admin_client, tenant):
    response = patch(admin_client, f"{URL}/acme", {
        "name": "Acme Inc", "status": "suspended", "quotas": {"tokens_per_minute": 1000, "max_l3_bytes": 5},
    })
    assert response.status_code == 200
    body = response.json()
    assert body["name"] == "Acme Inc" and body["status"] == "suspended"
    assert body["quotas"]["tokens_per_minute"] == 1000 and body["quotas"]["max_l3_bytes"] == 5
    assert audit_actions()[-3:] == ["tenant.update", "tenant.suspend", "tenant.quotas"]


def test_patch_quota_null_means_unlimited_and_omitted_quotas_are_kept(admin_client, tenant):
    patch(admin_client, f"{URL}/acme", {"quotas": {"requests_per_minute": 5, "max_prompt_tokens": 100}})
    body = patch(admin_client, f"{URL}/acme", {"quotas": {"requests_per_minute": None}}).json()
    assert body["quotas"]["requests_per_minute"] is None
    assert body["quotas"]["max_prompt_tokens"] == 100


@pytest.mark.parametrize("bad", [0, 101, -1, "3", True])
def test_share_weight_quota_is_1_to_100_and_anything_else_is_422_and_changes_nothing(admin_client, tenant, bad):
    from controlplane.tenants.models import Tenant

    assert patch(admin_client, f"{URL}/acme", {"quotas": {"share_weight": bad}}).status_code == 422
    assert Tenant.objects.get(slug="acme").share_weight is None
    body = patch(admin_client, f"{URL}/acme", {"quotas": {"share_weight": 3}}).json()
    assert body["quotas"]["share_weight"] == 3 and Tenant.objects.get(slug="acme").share_weight == 3


def test_patch_without_changes_records_nothing(admin_client, tenant):
    before = audit_actions()
    assert patch(admin_client, f"{URL}/acme", {"name": "Acme Corp"}).status_code == 200
    assert audit_actions() == before


def test_reactivating_a_suspended_tenant_works(admin_client, tenant):
    patch(admin_client, f"{URL}/acme", {"status": "suspended"})
    assert patch(admin_client, f"{URL}/acme", {"status": "active"}).json()["status"] == "active"
    assert audit_actions()[-2:] == ["tenant.suspend", "tenant.activate"]


def test_patch_cannot_set_offboarded_status(admin_client, tenant):
    assert_error(patch(admin_client, f"{URL}/acme", {"status": "offboarded"}), 422, "validation_error")


def test_delete_offboards_revokes_keys_and_is_audited(admin_client, tenant, actor):
    from controlplane.tenants.services import api_key_create

    key, _ = api_key_create(actor=actor, tenant=tenant)
    response = admin_client.delete(f"{URL}/acme?reason=contract+ended")
    assert response.status_code == 200
    body = response.json()
    assert body["tenant"]["status"] == "offboarded" and body["keys_revoked"] == 1
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert audit_actions()[-1] == "tenant.offboard"


def test_offboarded_tenant_cannot_be_changed_or_given_keys(admin_client, tenant):
    admin_client.delete(f"{URL}/acme")
    assert_error(patch(admin_client, f"{URL}/acme", {"status": "active"}), 409, "tenant_offboarded")
    assert_error(post(admin_client, f"{URL}/acme/keys", {}), 409, "tenant_offboarded")


def test_offboard_requests_one_offboard_job(tenant, actor, monkeypatch):
    from controlplane.jobs import services as jobs
    from controlplane.tenants import services

    calls = []

    class Job:
        pk, status = 41, "queued"

    def flush_job_request(**kwargs):
        calls.append(kwargs)
        return Job()

    monkeypatch.setattr(jobs, "flush_job_request", flush_job_request)
    result = services.tenant_offboard(actor=actor, tenant=tenant, reason="bye")
    assert result.flush_job.pk == 41 and result.tenant.status == "offboarded"
    assert calls == [{"actor": actor, "scope": "tenant", "tenant": result.tenant, "reason": "bye", "kind": "offboard"}]


def test_unknown_tenant_is_404_for_every_verb(admin_client):
    assert_error(admin_client.get(f"{URL}/nope"), 404, "tenant_not_found")
    assert_error(patch(admin_client, f"{URL}/nope", {"name": "x"}), 404)
    assert_error(admin_client.delete(f"{URL}/nope"), 404)
    assert_error(admin_client.get(f"{URL}/nope/keys"), 404)


def test_duplicate_slug_is_409_and_first_tenant_is_untouched(admin_client, tenant):
    assert_error(post(admin_client, URL, {"slug": "acme", "name": "Other"}), 409, "conflict")
    assert admin_client.get(f"{URL}/acme").json()["name"] == "Acme Corp"


@pytest.mark.parametrize("payload", [
    {"slug": "Bad_Slug", "name": "x"},
    {"slug": "-edge", "name": "x"},
    {"slug": "ok", "name": ""},
    {"slug": "ok", "name": 5},
    {"slug": "ok"},
    {"slug": "ok", "name": "x", "quotas": {"requests_per_minute": "10"}},
    {"slug": "ok", "name": "x", "quotas": {"requests_per_minute": -1}},
    {"slug": "ok", "name": "x", "quotas": {"requests_per_minute": True}},
    {"slug": "ok", "name": "x", "quotas": {"unknown_quota": 1}},
    {"slug": "ok", "name": "x", "extra": 1},
    ["not", "an", "object"],
])
def test_malformed_tenant_payloads_are_422_and_create_nothing(admin_client, payload):
    assert_error(post(admin_client, URL, payload), 422, "validation_error")
    assert admin_client.get(URL).json() == []
