"""Grants (ACL) and share groups: what a tenant may use and whose cache it shares."""

import pytest

from tests.controlplane.helpers import assert_error, audit_actions, post

pytestmark = pytest.mark.django_db
GRANTS = "/api/admin/tenants/acme/grants"


def test_grant_create_list_delete_roundtrip(admin_client, tenant, model):
    response = post(admin_client, GRANTS, {"model": "tiny-llama"})
    assert response.status_code == 201 and response.json()["model"] == "tiny-llama"
    assert [g["model"] for g in admin_client.get(GRANTS).json()] == ["tiny-llama"]
    assert admin_client.delete(f"{GRANTS}/tiny-llama").status_code == 204
    assert admin_client.get(GRANTS).json() == []
    assert audit_actions()[-2:] == ["grant.create", "grant.delete"]


def test_duplicate_grant_is_409(admin_client, tenant, model):
    post(admin_client, GRANTS, {"model": "tiny-llama"})
    assert_error(post(admin_client, GRANTS, {"model": "tiny-llama"}), 409)


def test_grant_of_unknown_model_is_404_and_deleting_missing_grant_is_404(admin_client, tenant, model):
    assert_error(post(admin_client, GRANTS, {"model": "nope"}), 404, "model_not_found")
    assert_error(admin_client.delete(f"{GRANTS}/tiny-llama"), 404)


def test_ungranted_model_looks_exactly_like_unknown_model(tenant, model, actor):
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.selectors import grant_get_deployment

    assert grant_get_deployment(tenant, "tiny-llama") is None
    assert grant_get_deployment(tenant, "no-such-model") is None
    grant_create(actor=actor, tenant=tenant, deployment=model)
    granted = grant_get_deployment(tenant, "tiny-llama")
    assert granted is not None and granted.active_revision.label == "r1"


def test_grant_for_one_tenant_does_not_leak_to_another(tenant, model, actor):
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.selectors import grant_get_deployment
    from controlplane.tenants.services import tenant_create

    other = tenant_create(actor=actor, slug="other", name="Other")
    grant_create(actor=actor, tenant=tenant, deployment=model)
    assert grant_get_deployment(tenant, "tiny-llama") is not None
    assert grant_get_deployment(other, "tiny-llama") is None


def test_share_group_members_share_a_salt_and_non_members_do_not(admin_client, actor):
    from controlplane.tenants.selectors import tenant_get, tenant_scope_fingerprint, tenant_scope_salt
    from controlplane.tenants.services import tenant_create

    for slug in ("a", "b", "c"):
        tenant_create(actor=actor, slug=slug, name=slug.upper())
    assert post(admin_client, "/api/admin/share-groups", {"slug": "team", "name": "Team"}).status_code == 201
    for slug in ("a", "b"):
        assert post(admin_client, "/api/admin/share-groups/team/members", {"tenant": slug}).status_code == 201
    a, b, c = (tenant_get(slug=s) for s in ("a", "b", "c"))
    assert tenant_scope_salt(a) == tenant_scope_salt(b)
    assert tenant_scope_salt(a) != tenant_scope_salt(c)
    assert len(tenant_scope_salt(a)) == 32
    assert tenant_scope_fingerprint(a) == tenant_scope_fingerprint(b) != tenant_scope_fingerprint(c)
    group = admin_client.get("/api/admin/share-groups/team").json()
    assert group["members"] == ["a", "b"] and "salt" not in str(group)


def test_leaving_a_share_group_restores_the_tenants_own_salt(admin_client, actor):
    from controlplane.tenants.selectors import tenant_get, tenant_scope_salt
    from controlplane.tenants.services import tenant_create

    tenant = tenant_create(actor=actor, slug="a", name="A")
    own = tenant_scope_salt(tenant)
    post(admin_client, "/api/admin/share-groups", {"slug": "team", "name": "Team"})
    post(admin_client, "/api/admin/share-groups/team/members", {"tenant": "a"})
    assert tenant_scope_salt(tenant_get(slug="a")) != own
    assert admin_client.delete("/api/admin/share-groups/team/members/a").status_code == 204
    assert tenant_scope_salt(tenant_get(slug="a")) == own
    actions = audit_actions()
    assert actions[-1] == "share_group.remove"
    assert [a for a in actions if a.startswith("share_group.")][-3:] == [
        "share_group.create", "share_group.add", "share_group.remove"]
    # Leaving flushes what the tenant created (in the group's namespace too): a tenant flush job.
    from controlplane.jobs.models import FlushJob

    job = FlushJob.objects.get(scope="tenant", tenant=tenant)
    assert job.reason == "left share group team"


def test_share_group_membership_is_exclusive_and_conflicts_are_409(admin_client, tenant):
    post(admin_client, "/api/admin/share-groups", {"slug": "one", "name": "One"})
    post(admin_client, "/api/admin/share-groups", {"slug": "two", "name": "Two"})
    assert_error(post(admin_client, "/api/admin/share-groups", {"slug": "one", "name": "Again"}), 409)
    post(admin_client, "/api/admin/share-groups/one/members", {"tenant": "acme"})
    assert_error(post(admin_client, "/api/admin/share-groups/two/members", {"tenant": "acme"}), 409)
    assert_error(admin_client.delete("/api/admin/share-groups/two/members/acme"), 404)
    assert_error(post(admin_client, "/api/admin/share-groups/nope/members", {"tenant": "acme"}), 404)
