"""The Django admin at /admin/ is for staff, read-only, and never shows salts or key hashes."""

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_browser(django_user_model):
    browser = Client()
    browser.force_login(django_user_model.objects.create_superuser("boss", "boss@example.com", "pw"))
    return browser


def test_admin_pages_show_fingerprints_but_never_salts_or_key_hashes(staff_browser, tenant, actor):
    from controlplane.tenants.selectors import tenant_scope_fingerprint
    from controlplane.tenants.services import api_key_create

    key, raw = api_key_create(actor=actor, tenant=tenant)
    pages = [f"/admin/tenants/tenant/{tenant.pk}/change/", "/admin/tenants/apikey/",
             f"/admin/tenants/apikey/{key.pk}/change/", "/admin/tenants/tenant/"]
    for url in pages:
        response = staff_browser.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert bytes(tenant.scope_salt).hex() not in html and key.key_hash not in html and raw not in html
    detail = staff_browser.get(f"/admin/tenants/tenant/{tenant.pk}/change/").content.decode()
    assert tenant_scope_fingerprint(tenant) in detail and key.prefix in detail


def test_admin_cannot_add_change_or_delete_audited_records(staff_browser, tenant):
    assert staff_browser.get("/admin/tenants/tenant/add/").status_code == 403
    assert staff_browser.post(f"/admin/tenants/tenant/{tenant.pk}/delete/", {"post": "yes"}).status_code == 403
    assert staff_browser.get("/admin/audit/auditevent/").status_code == 200
    tenant.refresh_from_db()
    assert tenant.name == "Acme Corp"


def test_admin_site_needs_a_staff_login(client):
    response = client.get("/admin/tenants/tenant/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
