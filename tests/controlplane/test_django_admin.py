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


# ---------------------------------------------------------------------- user privileges
@pytest.fixture
def viewer(django_user_model):
    return django_user_model.objects.create_user("victor", "victor@example.com", "pw", is_staff=True)


def privilege_events():
    from controlplane.audit.models import AuditEvent

    return list(AuditEvent.objects.filter(action__startswith="user.").order_by("seq"))


def test_the_admin_shows_privilege_flags_read_only_and_ignores_them_when_posted(staff_browser, viewer):
    url = f"/admin/auth/user/{viewer.pk}/change/"
    html = staff_browser.get(url).content.decode()
    assert 'name="first_name"' in html
    for flag in ("is_staff", "is_superuser", "is_active", "groups", "user_permissions"):
        assert f'name="{flag}"' not in html, flag
    before = len(privilege_events())
    response = staff_browser.post(url, {"username": "victor", "first_name": "Victor", "last_name": "",
                                        "email": "victor@example.com", "is_superuser": "on", "is_staff": "on",
                                        "is_active": "on", "_save": "Save"})
    assert response.status_code == 302, response.content.decode()[:2000]
    viewer.refresh_from_db()
    assert viewer.first_name == "Victor" and viewer.is_superuser is False  # saved, flag ignored
    assert len(privilege_events()) == before


def test_only_superusers_may_change_users_in_the_admin(viewer, django_user_model):
    from django.contrib.auth.models import Permission

    viewer.user_permissions.add(*Permission.objects.filter(codename__in=["change_user", "view_user"]))
    boss = django_user_model.objects.create_superuser("boss2", "boss2@example.com", "pw")
    browser = Client()
    browser.force_login(viewer)
    assert browser.post(f"/admin/auth/user/{boss.pk}/password/", {"password1": "x" * 20, "password2": "x" * 20,
                                                                  "usable_password": "true"}).status_code == 403
    assert browser.post(f"/admin/auth/user/{boss.pk}/change/", {"username": "pwned"}).status_code == 403
    boss.refresh_from_db()
    assert boss.username == "boss2" and boss.check_password("pw")
    assert browser.get("/admin/auth/group/add/").status_code == 403


def test_any_flag_change_outside_the_service_is_still_audited(viewer):
    viewer.is_superuser = True
    viewer.save()
    (event,) = [e for e in privilege_events() if e.action == "user.privileges"]
    assert (event.target, event.actor, event.old_value["is_superuser"], event.new_value["is_superuser"]) == (
        "victor", "system:unattributed", False, True)
    viewer.last_login = viewer.date_joined
    viewer.save(update_fields=["last_login"])
    viewer.first_name = "V"
    viewer.save()
    assert len([e for e in privilege_events() if e.action == "user.privileges"]) == 1


def test_creating_a_privileged_user_is_audited(django_user_model):
    django_user_model.objects.create_user("plain", password="pw")
    django_user_model.objects.create_superuser("root2", "root2@example.com", "pw")
    assert [(e.action, e.target, e.new_value["is_superuser"]) for e in privilege_events()] == [
        ("user.create", "root2", True)]


def test_the_privileges_service_writes_one_attributed_event(viewer, actor):
    from controlplane.operators.accounts import user_privileges_set

    user_privileges_set(actor=actor, user=viewer, is_superuser=True, reason="on call")
    user_privileges_set(actor=actor, user=viewer, is_superuser=True)  # no change, no event
    viewer.refresh_from_db()
    assert viewer.is_superuser is True
    events = [e for e in privilege_events() if e.action == "user.privileges"]
    assert [(e.actor, e.reason, e.old_value["is_superuser"], e.new_value["is_superuser"]) for e in events] == [
        ("system:tests", "on call", False, True)]
