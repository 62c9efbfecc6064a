"""Operator password logins, on the UI (/ui/login/) and the Django admin (/admin/login/): throttled
per account and per source (a locked attempt is a 429 lockout page and no password is checked),
failures audited as aggregated events naming the account and the source, successes as
``auth.login``."""

import pytest
from django.test import Client

from tests.controlplane.helpers import audit_events

pytestmark = pytest.mark.django_db
PASSWORD = "correct horse battery staple"
PAGES = {"ui": "/ui/login/", "admin": "/admin/login/"}


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_superuser("alice", "alice@example.com", PASSWORD)


@pytest.fixture
def password_checks(monkeypatch):
    """Every call of Django's ``authenticate`` made by the login forms."""
    from django.contrib.auth import forms

    calls, real = [], forms.authenticate
    monkeypatch.setattr(forms, "authenticate", lambda *a, **kw: calls.append(kw.get("username")) or real(*a, **kw))
    return calls


def login(via, username, password, address="203.0.113.7"):
    return Client(REMOTE_ADDR=address).post(PAGES[via], {"username": username, "password": password})


def logged_in(response) -> bool:
    return response.status_code == 302


@pytest.mark.parametrize("via", ["ui", "admin"])
def test_five_failures_lock_the_account_and_the_next_attempt_checks_no_password(
        via, alice, clock, password_checks):
    from controlplane.operators.authguard import LOGIN_ACCOUNT_LIMIT

    for _ in range(LOGIN_ACCOUNT_LIMIT):
        assert login(via, "alice", "wrong").status_code == 200
    assert len(password_checks) == LOGIN_ACCOUNT_LIMIT
    locked = login(via, "alice", PASSWORD)
    assert locked.status_code == 429 and "Too many failed logins" in locked.content.decode()
    assert 60 < int(locked["Retry-After"]) <= 15 * 60
    assert len(password_checks) == LOGIN_ACCOUNT_LIMIT and "_auth_user_id" not in locked.client.session
    assert login(via, "alice", PASSWORD, address="198.51.100.1").status_code == 429  # the account, anywhere
    clock.advance(15 * 60 + 1)
    assert logged_in(login(via, "alice", PASSWORD))


@pytest.mark.parametrize("via", ["ui", "admin"])
def test_failures_are_one_aggregated_event_naming_account_and_source_and_never_the_password(via, alice, clock):
    for _ in range(3):
        login(via, "alice", "hunter2-wrong")
    login(via, "bob", "hunter2-wrong")
    failed = audit_events("auth.failed")
    assert [(e.actor, e.source, e.target, e.new_value["account"], e.new_value["count"]) for e in failed] == [
        ("alice", "203.0.113.7", f"login:{via}", "alice", 1), ("bob", "203.0.113.7", f"login:{via}", "bob", 1)]
    assert all(e.auth_method == "password" and e.result == "denied" for e in failed)
    clock.advance(61)
    login(via, "alice", "hunter2-wrong")
    assert audit_events("auth.failed")[-1].new_value["count"] == 3
    everything = str([(e.actor, e.target, e.reason, e.old, e.new) for e in audit_events("auth.failed")])
    assert "hunter2" not in everything and PASSWORD not in everything


@pytest.mark.parametrize("via", ["ui", "admin"])
def test_a_successful_login_is_audited_and_clears_the_account_count(via, alice, clock):
    from controlplane.operators.authguard import LOGIN_ACCOUNT_LIMIT

    for _ in range(LOGIN_ACCOUNT_LIMIT - 1):
        login(via, "alice", "wrong")
    assert logged_in(login(via, "alice", PASSWORD))
    (event,) = audit_events("auth.login")
    assert (event.actor, event.auth_method, event.source, event.target) == (
        "alice", "password", "203.0.113.7", f"login:{via}")
    for _ in range(LOGIN_ACCOUNT_LIMIT - 1):
        login(via, "alice", "wrong")
    assert logged_in(login(via, "alice", PASSWORD))


def test_one_source_trying_many_accounts_is_locked_out_for_all_of_them(alice, clock, password_checks):
    from controlplane.operators.authguard import LOGIN_SOURCE_LIMIT

    for i in range(LOGIN_SOURCE_LIMIT):
        login("ui" if i % 2 else "admin", f"user{i}", "wrong")
    checked = len(password_checks)
    assert login("ui", "alice", PASSWORD).status_code == 429
    assert login("admin", "alice", PASSWORD).status_code == 429
    assert len(password_checks) == checked
    assert logged_in(login("ui", "alice", PASSWORD, address="198.51.100.1"))
    assert audit_events("auth.throttled")[0].new_value["account"] == "alice"


def test_a_correct_password_of_a_non_staff_account_counts_as_a_failure(django_user_model, clock):
    django_user_model.objects.create_user("mallory", password=PASSWORD)
    response = login("ui", "mallory", PASSWORD)
    assert response.status_code == 200 and "staff account" in response.content.decode()
    (event,) = audit_events("auth.failed")
    assert (event.actor, event.reason) == ("mallory", "not an active staff account")


def test_case_variants_of_a_username_share_one_lock(alice, clock):
    from controlplane.operators.authguard import LOGIN_ACCOUNT_LIMIT

    for i in range(LOGIN_ACCOUNT_LIMIT):
        login("ui", "ALICE" if i % 2 else "alice", "wrong")
    assert login("ui", "Alice", "wrong").status_code == 429
