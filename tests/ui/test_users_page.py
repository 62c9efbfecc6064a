"""Console logins: admins create them with a role and disable, enable or change them, audited;
viewers only read; the last active admin stays."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.test import Client


@pytest.fixture
def admin_ui(db):
    user = get_user_model().objects.create_user("boss", password="pw-boss-123!", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


def _audit(action):
    from controlplane.audit.models import AuditEvent

    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


def test_an_admin_creates_a_viewer_login_that_can_log_in_and_only_read(admin_ui):
    page = admin_ui.get("/ui/users/")
    assert page.status_code == 200 and "Create a login" in page.content.decode()
    bad = admin_ui.post("/ui/users/", {"username": "ann", "password": "123", "role": "viewer"})
    assert bad.status_code == 422 and "too short" in bad.content.decode()
    ok = admin_ui.post("/ui/users/", {"username": "ann", "password": "a-long-secret-9", "role": "viewer"})
    assert ok.status_code == 302
    ann = get_user_model().objects.get(username="ann")
    assert ann.is_staff and not ann.is_superuser and ann.check_password("a-long-secret-9")
    created = _audit("user.create")
    assert created[-1].actor == "boss" and created[-1].target == "ann" and "secret" not in (created[-1].new or "")
    dup = admin_ui.post("/ui/users/", {"username": "ann", "password": "a-long-secret-9", "role": "viewer"})
    assert dup.status_code == 409
    viewer = Client()
    assert viewer.login(username="ann", password="a-long-secret-9")
    assert viewer.get("/ui/users/").status_code == 200
    assert "Create a login" not in viewer.get("/ui/users/").content.decode()
    refused = viewer.post("/ui/users/", {"username": "eve", "password": "a-long-secret-9", "role": "admin"})
    assert refused.status_code == 403
    assert not get_user_model().objects.filter(username="eve").exists()


def test_disable_enable_and_role_changes_are_audited_and_the_last_admin_stays(admin_ui):
    admin_ui.post("/ui/users/", {"username": "bob", "password": "a-long-secret-9", "role": "viewer"})
    bob = get_user_model().objects.get(username="bob")
    assert admin_ui.post(f"/ui/users/{bob.pk}/", {"action": "disable"}).status_code == 302
    bob.refresh_from_db()
    assert not bob.is_active
    assert not Client().login(username="bob", password="a-long-secret-9")
    admin_ui.post(f"/ui/users/{bob.pk}/", {"action": "enable"})
    admin_ui.post(f"/ui/users/{bob.pk}/", {"action": "make-admin"})
    bob.refresh_from_db()
    assert bob.is_active and bob.is_superuser
    changes = _audit("user.privileges")
    assert [e.actor for e in changes] == ["boss"] * 3
    boss = get_user_model().objects.get(username="boss")
    admin_ui.post(f"/ui/users/{bob.pk}/", {"action": "make-viewer"})
    last = admin_ui.post(f"/ui/users/{boss.pk}/", {"action": "disable"})
    assert last.status_code == 409 and "last active admin" in last.content.decode()
    boss.refresh_from_db()
    assert boss.is_active
    page = admin_ui.get("/ui/users/").content.decode()
    assert re.search(r"bob</th>\s*<td><span class=\"badge role-viewer\">viewer", page)
    assert 'href="/admin/"' in page
