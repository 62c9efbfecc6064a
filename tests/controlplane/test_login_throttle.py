"""Operator password logins, on the UI (/ui/login/) and the Django admin (/admin/login/): throttled
per (account, source) with progressive delays and per source (a locked attempt is a 429 lockout page
and no password is checked), never per account alone (anonymous clients cannot lock an operator
out); failures and lockouts audited as aggregated events naming the account and the source,
successes as ``auth.login``; lockouts listed on the dashboard."""

import pytest
from django.test import Client

from tests.controlplane.helpers import audit_events

pytestmark = pytest.mark.django_db
PASSWORD = "correct horse battery staple"
PAGES = {"ui": "/ui/login/", "admin": "/admin/login/"}
ATTACKER = "203.0.113.7"
OPERATOR = "198.51.100.1"


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
def test_wrong_passwords_for_admin_from_one_source_do_not_lock_admin_out_from_another(
        via, alice, clock, password_checks):
    from controlplane.operators.authguard import LOGIN_FREE_FAILURES

    for _ in range(LOGIN_FREE_FAILURES):
        assert login(via, "alice", "wrong", address=ATTACKER).status_code == 200
    assert len(password_checks) == LOGIN_FREE_FAILURES
    assert logged_in(login(via, "alice", PASSWORD, address=OPERATOR))  # a clean source gets in
    locked = login(via, "alice", PASSWORD, address=ATTACKER)  # the attacker's source is locked
    assert locked.status_code == 429 and "Too many failed logins" in locked.content.decode()
    assert 0 < int(locked["Retry-After"]) <= 60
    assert len(password_checks) == LOGIN_FREE_FAILURES + 1 and "_auth_user_id" not in locked.client.session


def test_each_further_failure_from_a_locked_source_doubles_the_delay_up_to_the_cap(alice, clock, password_checks):
    from controlplane.operators.authguard import LOGIN_DELAY_MAX_S, LOGIN_DELAY_S, LOGIN_FREE_FAILURES

    for _ in range(LOGIN_FREE_FAILURES):
        login("ui", "alice", "wrong", address=ATTACKER)
    delays = []
    for _ in range(6):
        delay = int(login("ui", "alice", "wrong", address=ATTACKER)["Retry-After"])
        delays.append(delay)
        clock.advance(delay - 1)
        assert login("ui", "alice", PASSWORD, address=ATTACKER).status_code == 429  # still locked
        clock.advance(2)
        assert login("ui", "alice", "wrong", address=ATTACKER).status_code == 200  # checked again: a failure
    assert delays == [min(LOGIN_DELAY_S * 2 ** i, LOGIN_DELAY_MAX_S) for i in range(6)]
    assert delays[-1] == LOGIN_DELAY_MAX_S
    assert len(password_checks) == LOGIN_FREE_FAILURES + 6
    assert logged_in(login("ui", "alice", PASSWORD, address=OPERATOR))


def test_a_lockout_is_audited_with_account_source_and_until_and_shown_on_the_dashboard(alice, clock):
    from controlplane.operators.authguard import LOGIN_FREE_FAILURES

    for _ in range(LOGIN_FREE_FAILURES):
        login("ui", "alice", "wrong", address=ATTACKER)
    (event,) = audit_events("auth.lockout")
    assert (event.actor, event.source, event.target, event.result) == ("alice", ATTACKER, "login:ui", "denied")
    assert event.new_value["account"] == "alice" and event.new_value["seconds"] == 60
    assert event.new_value["failures"] == LOGIN_FREE_FAILURES and event.new_value["until"]
    operator = Client(REMOTE_ADDR=OPERATOR)
    operator.force_login(alice)
    page = operator.get("/ui/").content.decode()
    panel = page[page.index('id="h-lockouts"'):]
    panel = panel[:panel.index("</section>")]
    assert "alice" in panel and ATTACKER in panel and "locked" in panel
    assert event.new_value["until"][:19].replace("T", " ") in panel


def test_a_dashboard_without_lockouts_says_so(alice):
    operator = Client()
    operator.force_login(alice)
    page = operator.get("/ui/").content.decode()
    assert "Login lockouts in the last hour" in page and "no account was locked out" in page


def test_past_the_account_ceiling_a_source_gets_one_free_failure_but_a_clean_source_still_gets_in(
        alice, clock, monkeypatch):
    from controlplane.operators import authguard

    monkeypatch.setattr(authguard, "LOGIN_ACCOUNT_CEILING", 6)
    for i in range(7):  # a distributed guess: many sources, one failure each
        assert login("ui", "alice", "wrong", address=f"10.7.0.{i + 1}").status_code == 200
    assert login("ui", "alice", "wrong", address="10.7.1.1").status_code == 200
    assert login("ui", "alice", PASSWORD, address="10.7.1.1").status_code == 429  # one failure: locked
    assert logged_in(login("ui", "alice", PASSWORD, address=OPERATOR))


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
def test_a_successful_login_is_audited_and_clears_its_sources_count(via, alice, clock):
    from controlplane.operators.authguard import LOGIN_FREE_FAILURES

    for _ in range(LOGIN_FREE_FAILURES - 1):
        login(via, "alice", "wrong")
    assert logged_in(login(via, "alice", PASSWORD))
    (event,) = audit_events("auth.login")
    assert (event.actor, event.auth_method, event.source, event.peer, event.target) == (
        "alice", "password", "203.0.113.7", "203.0.113.7", f"login:{via}")
    for _ in range(LOGIN_FREE_FAILURES - 1):
        login(via, "alice", "wrong")
    assert logged_in(login(via, "alice", PASSWORD))


def test_one_source_trying_many_accounts_is_slowed_for_all_of_them(alice, clock, password_checks):
    from controlplane.operators.authguard import LOGIN_SOURCE_FREE_FAILURES

    for i in range(LOGIN_SOURCE_FREE_FAILURES):
        login("ui" if i % 2 else "admin", f"user{i}", "wrong")
    checked = len(password_checks)
    assert login("ui", "alice", PASSWORD).status_code == 429
    assert login("admin", "alice", PASSWORD).status_code == 429
    assert len(password_checks) == checked
    assert logged_in(login("ui", "alice", PASSWORD, address=OPERATOR))
    assert audit_events("auth.throttled")[0].new_value["account"] == "alice"
    assert audit_events("auth.lockout")[-1].new_value["account"] == "*"


def test_a_correct_password_of_a_non_staff_account_counts_as_a_failure(django_user_model, clock):
    django_user_model.objects.create_user("mallory", password=PASSWORD)
    response = login("ui", "mallory", PASSWORD)
    assert response.status_code == 200 and "staff account" in response.content.decode()
    (event,) = audit_events("auth.failed")
    assert (event.actor, event.reason) == ("mallory", "not an active staff account")


def test_case_variants_of_a_username_share_one_lock(alice, clock):
    from controlplane.operators.authguard import LOGIN_FREE_FAILURES

    for i in range(LOGIN_FREE_FAILURES):
        login("ui", "ALICE" if i % 2 else "alice", "wrong")
    assert login("ui", "Alice", "wrong").status_code == 429
