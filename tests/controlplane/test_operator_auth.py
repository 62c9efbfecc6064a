"""Admin API authentication and roles: operator tokens, staff sessions with CSRF, viewers read only."""

import io

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from tests.controlplane.helpers import assert_error, audit_actions, patch, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"


def test_missing_token_is_401_with_www_authenticate(client):
    response = client.get(URL)
    assert_error(response, 401, "unauthenticated")
    assert response["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("header", ["Bearer st-op-wrongwrongwrong", "Bearer ", "Basic dXNlcjpwYXNz", "garbage"])
def test_bad_token_or_malformed_header_is_401_and_audited(header):
    response = Client(headers={"Authorization": header}).get(URL)
    assert_error(response, 401)
    assert audit_actions()[-1] == "auth.failed"


def test_failed_auth_audit_never_holds_the_presented_token():
    from controlplane.audit.models import AuditEvent

    bogus = "st-op-ABCDEFGHsecretpartthatmustnotleak"
    Client(headers={"Authorization": f"Bearer {bogus}"}).get(URL)
    event = AuditEvent.objects.order_by("-seq").first()
    assert event.result == "denied" and event.actor == "token:st-op-ABCDEFGH"
    assert "secretpart" not in f"{event.actor}{event.target}{event.reason}{event.old}{event.new}"


def test_viewer_reads_but_every_write_is_403(viewer_client, tenant):
    assert viewer_client.get(URL).status_code == 200
    assert viewer_client.get(f"{URL}/acme").status_code == 200
    assert viewer_client.get("/api/admin/audit").status_code == 200
    assert_error(post(viewer_client, URL, {"slug": "new", "name": "New"}), 403, "read_only_role")
    assert_error(patch(viewer_client, f"{URL}/acme", {"name": "x"}), 403)
    assert_error(viewer_client.delete(f"{URL}/acme"), 403)
    assert_error(post(viewer_client, f"{URL}/acme/keys", {}), 403)
    assert_error(post(viewer_client, "/api/admin/models", {"name": "m"}), 403)
    assert [t["slug"] for t in viewer_client.get(URL).json()] == ["acme"]
    assert viewer_client.get(f"{URL}/acme").json()["name"] == "Acme Corp"
    assert audit_actions()[-1] == "auth.denied"


def test_admin_actions_are_attributed_to_the_operator(admin_client):
    from controlplane.audit.models import AuditEvent

    post(admin_client, URL, {"slug": "acme", "name": "Acme"})
    event = AuditEvent.objects.get(action="tenant.create")
    assert (event.actor, event.auth_method, event.source) == ("admin-op", "token", "127.0.0.1")


def test_revoked_operator_token_is_401_at_once(admin_client, actor):
    from controlplane.operators.models import OperatorToken
    from controlplane.operators.services import operator_token_revoke

    assert admin_client.get(URL).status_code == 200
    operator_token_revoke(actor=actor, token=OperatorToken.objects.get(username="admin-op"))
    assert_error(admin_client.get(URL), 401)


def test_create_operator_token_prints_the_token_alone_on_its_last_line():
    from controlplane.operators.selectors import operator_authenticate

    out = io.StringIO()
    call_command("create_operator_token", "--username", "ops", "--role", "viewer", stdout=out)
    lines = out.getvalue().rstrip("\n").split("\n")
    token = lines[-1]
    assert token.startswith("st-op-") and " " not in token and len(token) > 40
    assert token not in "\n".join(lines[:-1])
    operator = operator_authenticate(token)
    assert operator is not None and (operator.username, operator.role) == ("ops", "viewer")
    assert audit_actions()[-1] == "operator_token.create"
    response = Client(headers={"Authorization": f"Bearer {token}"}).get(URL)
    assert response.status_code == 200


def test_create_operator_token_rejects_unknown_role():
    with pytest.raises(CommandError):
        call_command("create_operator_token", "--username", "ops", "--role", "root", stderr=io.StringIO())


def test_superuser_session_is_admin_and_staff_session_is_viewer(django_user_model):
    boss = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw")
    staff = django_user_model.objects.create_user("staff", password="pw", is_staff=True)
    admin_session, viewer_session = Client(), Client()
    admin_session.force_login(boss)
    viewer_session.force_login(staff)
    assert post(admin_session, URL, {"slug": "s1", "name": "S1"}).status_code == 201
    assert_error(post(viewer_session, URL, {"slug": "s2", "name": "S2"}), 403)
    assert viewer_session.get(URL).status_code == 200


def test_non_staff_session_is_401(django_user_model):
    user = django_user_model.objects.create_user("plain", password="pw")
    session = Client()
    session.force_login(user)
    assert_error(session.get(URL), 401)


def test_session_writes_need_csrf_and_bearer_writes_do_not(django_user_model, admin_client):
    boss = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(boss)
    assert browser.get(URL).status_code == 200  # reads need no token
    assert_error(post(browser, URL, {"slug": "s1", "name": "S1"}), 403, "csrf_failed")
    token = "a" * 16 + "B" * 16  # what the csrftoken cookie holds: a 32-character secret
    browser.cookies["csrftoken"] = token
    assert_error(post(browser, URL, {"slug": "s1", "name": "S1"}, headers={"X-CSRFToken": "c" * 32}), 403)
    assert post(browser, URL, {"slug": "s1", "name": "S1"}, headers={"X-CSRFToken": token}).status_code == 201
    bearer = Client(enforce_csrf_checks=True, headers={"Authorization": f"Bearer {admin_client.token}"})
    assert post(bearer, URL, {"slug": "s2", "name": "S2"}).status_code == 201
