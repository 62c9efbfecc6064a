"""Bad bearer tokens on the admin API: aggregated audit events (one per source per window, with a
count), a 429 with Retry-After past the limit (no token checked meanwhile), and a bounded log
whatever the number of sources."""

import pytest
from django.core.cache.backends.base import BaseCache
from django.test import Client

from tests.controlplane.helpers import assert_error, audit_actions, audit_events

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"
BAD = "Bearer st-op-AAAAAAAAnotarealtokenatall"


def attacker(address="203.0.113.7", header=BAD) -> Client:
    return Client(headers={"Authorization": header}, REMOTE_ADDR=address)


def test_bad_tokens_from_one_source_become_one_event_per_window_carrying_a_count(clock):
    for _ in range(7):
        assert_error(attacker().get(URL), 401)
    (first,) = audit_events("auth.failed")
    assert (first.source, first.actor, first.result) == ("203.0.113.7", "token:st-op-AAAAAAAA", "denied")
    assert first.new_value == {"kind": "token", "count": 1, "window_seconds": 60}
    clock.advance(61)
    assert_error(attacker().get(URL), 401)
    later = audit_events("auth.failed")[-1]
    assert later.new_value["count"] == 7  # the 6 counted in between, and this one
    assert sum(e.new_value["count"] for e in audit_events("auth.failed")) == 8
    assert_error(attacker("198.51.100.1").get(URL), 401)  # another source: its own event
    assert [e.source for e in audit_events("auth.failed")][-1] == "198.51.100.1"
    assert "notarealtoken" not in str([(e.actor, e.target, e.reason, e.new) for e in audit_events("auth.failed")])


def test_past_the_limit_a_source_gets_429_for_bad_tokens_and_malformed_ones_are_not_looked_up(clock, monkeypatch):
    from controlplane.adminapi import auth
    from controlplane.operators.authguard import TOKEN_FAILURE_LIMIT

    for _ in range(TOKEN_FAILURE_LIMIT):
        assert_error(attacker().get(URL), 401)
    checked = []
    real = auth.operator_token_match
    monkeypatch.setattr(auth, "operator_token_match", lambda token: checked.append(token) or real(token))
    response = attacker(header="Bearer not-even-shaped-like-a-token").get(URL)
    assert_error(response, 429, "auth_throttled")
    assert response.json()["error"]["type"] == "rate_limit_error" and 1 <= int(response["Retry-After"]) <= 60
    assert_error(attacker(header="Basic dXNlcjpwYXNz").get(URL), 429, "auth_throttled")
    assert checked == []  # locked: what cannot be a token costs no lookup
    assert_error(attacker(header=f"Bearer st-op-{'A' * 43}").get(URL), 429, "auth_throttled")
    assert len(checked) == 1  # well formed: looked up, bad, still 429
    assert_error(attacker("198.51.100.1").get(URL), 401)  # another source is not locked
    refused = audit_events("auth.throttled")
    assert [(e.source, e.new_value["count"]) for e in refused] == [("203.0.113.7", 1)]
    clock.advance(61)
    assert_error(attacker().get(URL), 401)


def test_a_valid_operator_token_is_served_from_a_source_locked_by_anonymous_bad_tokens(clock, admin_client):
    # All traffic through one proxy address (not configured as trusted): the attackers and the
    # operator share the source. Failures are throttled, a valid credential never is.
    from controlplane.operators.authguard import TOKEN_FAILURE_LIMIT

    proxy = "192.0.2.10"
    for _ in range(TOKEN_FAILURE_LIMIT + 2):
        attacker(proxy).get(URL)
    assert_error(attacker(proxy).get(URL), 429, "auth_throttled")
    assert attacker(proxy, f"Bearer {admin_client.token}").get(URL).status_code == 200
    assert_error(attacker(proxy).get(URL), 429, "auth_throttled")  # and the lock still holds for failures


def test_an_ipv6_host_cannot_escape_the_limit_by_changing_addresses_within_its_64(clock):
    from controlplane.operators.authguard import TOKEN_FAILURE_LIMIT

    for i in range(TOKEN_FAILURE_LIMIT):
        assert_error(attacker(f"2001:db8:1:2::{i + 1:x}").get(URL), 401)
    assert_error(attacker("2001:db8:1:2::ffff").get(URL), 429)
    assert_error(attacker("2001:db8:1:3::1").get(URL), 401)


def test_malformed_headers_count_as_bad_tokens(clock):
    for header in ["Basic dXNlcjpwYXNz", "garbage", "Bearer "]:
        assert_error(attacker(header=header).get(URL), 401)
    (event,) = audit_events("auth.failed")
    assert (event.actor, event.reason) == ("anonymous", "malformed Authorization header")


def test_requests_without_credentials_write_nothing(clock):
    for _ in range(5):
        assert_error(Client(REMOTE_ADDR="203.0.113.7").get(URL), 401)
    assert audit_actions() == []


def test_a_flood_from_many_sources_adds_a_bounded_number_of_audit_events(clock, monkeypatch):
    from controlplane.audit import aggregate

    monkeypatch.setattr(aggregate, "EVENTS_PER_WINDOW", 20)
    for i in range(60):
        for _ in range(2):
            assert_error(attacker(f"10.0.{i // 250}.{i % 250 + 1}").get(URL), 401)
    failed = audit_events("auth.failed")
    assert len(failed) == 21  # 20 sources of their own, then one pooled event for the rest
    pooled = failed[-1]
    assert (pooled.source, pooled.actor, pooled.new_value["pooled"]) == ("*", "*", True)
    assert sum(e.new_value["count"] for e in failed) <= 120


def test_new_sources_past_the_default_caches_size_never_reopen_the_pooled_window(clock):
    """Each new source writes per-key keys into the default cache (300 entries, culled when full); the
    window's cap and the pooled gate must not be culled with them, or every cull lets another pooled
    event through (17 for 2,000 sources, before they moved to the lockouts store)."""
    from controlplane.audit.aggregate import EVENTS_PER_WINDOW, audit_failure_record

    for i in range(2_000):
        audit_failure_record(action="auth.failed", kind="api_key", source=f"10.1.{i // 250}.{i % 250 + 1}",
                             actor="key:?", auth_method="api_key", target="GET /v1/models", reason="bad key")
    failed = audit_events("auth.failed")
    pooled = [e for e in failed if e.source == "*"]
    assert len(pooled) == 1 and len(failed) == EVENTS_PER_WINDOW + 1


def test_metrics_are_throttled_like_the_api(clock):
    from controlplane.operators.authguard import TOKEN_FAILURE_LIMIT

    for _ in range(TOKEN_FAILURE_LIMIT):
        assert_error(attacker().get("/metrics"), 401)
    assert_error(attacker().get("/metrics"), 429, "auth_throttled")


class BrokenCache(BaseCache):
    """A cache whose server is down: every operation raises."""

    def __init__(self, location, params):
        super().__init__(params)

    def __getattribute__(self, name):
        if name in {"add", "get", "set", "incr", "decr", "delete", "delete_many", "get_many", "clear"}:
            raise ConnectionError("cache server unreachable")
        return super().__getattribute__(name)


def test_a_cache_outage_fails_open_and_every_failure_is_audited(settings, admin_client):
    settings.CACHES = {alias: {"BACKEND": "tests.controlplane.test_auth_throttle.BrokenCache"}
                       for alias in ("default", "limits", "lockouts")}
    assert admin_client.get(URL).status_code == 200
    for _ in range(3):
        assert_error(attacker().get(URL), 401)
    assert len(audit_events("auth.failed")) == 3


def test_csrf_failures_of_a_session_are_aggregated(clock, django_user_model):
    from tests.controlplane.helpers import post

    browser = Client(enforce_csrf_checks=True, REMOTE_ADDR="203.0.113.9")
    browser.force_login(django_user_model.objects.create_superuser("boss", "boss@example.com", "pw"))
    for _ in range(4):
        assert_error(post(browser, URL, {"slug": "s1", "name": "S1"}), 403, "csrf_failed")
    (event,) = audit_events("auth.failed")
    assert (event.actor, event.auth_method, event.reason, event.new_value["kind"]) == (
        "boss", "session", "CSRF check failed", "csrf")


# ---------------------------------------------------------------------- tenant API keys (/v1/)
def test_a_valid_tenant_key_is_served_from_a_source_locked_by_bad_keys(clock, actor, monkeypatch):
    from controlplane.serving import keyguard
    from controlplane.tenants import selectors
    from controlplane.tenants.services import api_key_create, tenant_create

    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    _, raw = api_key_create(actor=actor, tenant=tenant)
    proxy = "192.0.2.10"

    def tenant_client(header):
        return Client(headers={"Authorization": header}, REMOTE_ADDR=proxy)

    for _ in range(keyguard.FAILURE_LIMIT):
        assert_error(tenant_client(f"Bearer sk-st-{'B' * 43}").get("/v1/models"), 401, "invalid_api_key")
    looked_up = []
    real = selectors.tenant_authenticate
    monkeypatch.setattr(selectors, "tenant_authenticate", lambda key: looked_up.append(key) or real(key))
    assert_error(tenant_client("Bearer junk").get("/v1/models"), 429, "auth_throttled")
    assert looked_up == []  # locked: what cannot be a key costs no lookup
    assert_error(tenant_client(f"Bearer sk-st-{'B' * 43}").get("/v1/models"), 429, "auth_throttled")
    assert tenant_client(f"Bearer {raw}").get("/v1/models").status_code == 200
    failed = audit_events("auth.failed")
    assert failed[0].new_value["kind"] == "api_key" and failed[0].source == proxy
    assert raw not in str([(e.actor, e.target, e.reason, e.new) for e in audit_events("auth.failed")])
    clock.advance(61)
    assert_error(tenant_client("Bearer junk").get("/v1/models"), 401, "invalid_api_key")
