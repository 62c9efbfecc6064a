"""Where a request comes from (``common.sources``): ``X-Forwarded-For`` is believed only from the
proxies in ``STRATA_TRUSTED_PROXIES`` (none by default), the source is the right-most address a
trusted proxy vouches for, and audit events keep the peer and the chain as received."""

import pytest
from django.test import Client, RequestFactory

from tests.controlplane.helpers import assert_error, audit_events, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"
BAD = "Bearer st-op-AAAAAAAAnotarealtokenatall"
PROXY = "192.0.2.10"


def source_of(peer: str, forwarded: str | None = None):
    from controlplane.common.sources import request_source

    extra = {"REMOTE_ADDR": peer}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return request_source(RequestFactory().get("/", **extra))


def test_rotating_forwarded_addresses_from_an_untrusted_peer_are_throttled_as_one_source(clock):
    from controlplane.operators.authguard import TOKEN_FAILURE_LIMIT

    statuses = [Client(headers={"Authorization": BAD, "X-Forwarded-For": f"10.9.{i}.1"},
                       REMOTE_ADDR="127.0.0.1").get(URL).status_code for i in range(30)]
    assert statuses[:TOKEN_FAILURE_LIMIT] == [401] * TOKEN_FAILURE_LIMIT
    assert set(statuses[TOKEN_FAILURE_LIMIT:]) == {429}
    assert {e.source for e in audit_events("auth.failed")} == {"127.0.0.1"}


def test_an_admin_action_with_a_forged_forwarded_header_is_audited_with_the_peer_and_the_chain(admin_client):
    response = post(admin_client, URL, {"slug": "acme", "name": "Acme"}, REMOTE_ADDR="127.0.0.1",
                    HTTP_X_FORWARDED_FOR="6.6.6.6")
    assert response.status_code == 201, response.content
    (event,) = audit_events("tenant.create")
    assert (event.source, event.peer, event.forwarded_for) == ("127.0.0.1", "127.0.0.1", "6.6.6.6")
    listed = admin_client.get("/api/admin/audit", {"action": "tenant.create"}).json()["items"][0]
    assert (listed["source"], listed["peer"], listed["forwarded_for"]) == ("127.0.0.1", "127.0.0.1", "6.6.6.6")


def test_behind_a_trusted_proxy_the_client_it_names_is_the_source_and_forged_hops_are_ignored(
        settings, admin_client):
    settings.STRATA_TRUSTED_PROXIES = (f"{PROXY}/32",)
    response = post(admin_client, URL, {"slug": "acme", "name": "Acme"}, REMOTE_ADDR=PROXY,
                    HTTP_X_FORWARDED_FOR="6.6.6.6, 203.0.113.5")
    assert response.status_code == 201, response.content
    (event,) = audit_events("tenant.create")
    assert (event.source, event.peer, event.forwarded_for) == ("203.0.113.5", PROXY, "6.6.6.6, 203.0.113.5")


def test_behind_a_trusted_proxy_clients_are_throttled_apart(settings, clock, admin_client):
    from controlplane.operators.authguard import TOKEN_FAILURE_LIMIT

    settings.STRATA_TRUSTED_PROXIES = (f"{PROXY}/32",)

    def via_proxy(client_address, header=BAD):
        return Client(headers={"Authorization": header, "X-Forwarded-For": client_address}, REMOTE_ADDR=PROXY)

    for _ in range(TOKEN_FAILURE_LIMIT):
        assert_error(via_proxy("203.0.113.5").get(URL), 401)
    assert_error(via_proxy("203.0.113.5").get(URL), 429, "auth_throttled")
    assert_error(via_proxy("198.51.100.8").get(URL), 401)  # another client behind the same proxy


def test_the_source_is_the_right_most_address_that_is_not_a_trusted_proxy(settings):
    settings.STRATA_TRUSTED_PROXIES = ("10.0.0.0/8", "2001:db8:ffff::/48")
    assert source_of("10.0.0.1", "6.6.6.6, 203.0.113.5, 10.1.1.1").source == "203.0.113.5"
    assert source_of("10.0.0.1", "203.0.113.5:4711").source == "203.0.113.5"
    assert source_of("10.0.0.1", "[2001:db8::7]:443").source == "2001:db8::7"
    assert source_of("2001:db8:ffff::1", "2001:db8::9").source == "2001:db8::9"
    assert source_of("10.0.0.1", "10.2.2.2, 10.3.3.3").source == "10.2.2.2"  # every hop is ours
    assert source_of("10.0.0.1", "203.0.113.5, unknown").source == "10.0.0.1"  # junk: stop at the peer
    assert source_of("10.0.0.1", "").source == "10.0.0.1"
    untrusted = source_of("203.0.113.9", "10.0.0.1, 1.2.3.4")
    assert (untrusted.source, untrusted.peer, untrusted.forwarded_for) == ("203.0.113.9", "203.0.113.9",
                                                                           "10.0.0.1, 1.2.3.4")


def test_nothing_is_trusted_by_default():
    from controlplane import env

    assert env.load({}).trusted_proxies == ()
    assert source_of("127.0.0.1", "6.6.6.6").source == "127.0.0.1"


def test_trusted_proxies_are_parsed_and_a_typo_is_refused():
    from controlplane import env

    loaded = env.load({"STRATA_TRUSTED_PROXIES": "10.0.0.1, 172.16.0.0/12,2001:db8::/32"})
    assert loaded.trusted_proxies == ("10.0.0.1/32", "172.16.0.0/12", "2001:db8::/32")
    with pytest.raises(env.EnvError, match="STRATA_TRUSTED_PROXIES"):
        env.load({"STRATA_TRUSTED_PROXIES": "10.0.0.300"})


def test_the_chain_fields_are_in_the_hash_and_older_events_without_them_verify_unchanged(admin_client):
    from controlplane.audit.chain import event_hash

    post(admin_client, URL, {"slug": "acme", "name": "Acme"}, REMOTE_ADDR="127.0.0.1",
         HTTP_X_FORWARDED_FOR="6.6.6.6")
    (event,) = audit_events("tenant.create")
    assert event_hash(event) == event.hash
    event.forwarded_for = "7.7.7.7"
    assert event_hash(event) != event.hash  # a rewritten chain is detected
    event.peer = event.forwarded_for = None
    legacy = event_hash(event)
    event.peer = event.forwarded_for = ""
    assert event_hash(event) == legacy  # events written before the columns existed hash as before


def test_the_audit_page_shows_the_peer_and_the_forwarded_chain(admin_client, django_user_model):
    post(admin_client, URL, {"slug": "acme", "name": "Acme"}, REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="6.6.6.6")
    browser = Client()
    browser.force_login(django_user_model.objects.create_superuser("boss", "boss@example.com", "pw"))
    page = browser.get("/ui/audit/", {"action": "tenant.create"}).content.decode()
    assert "(peer 127.0.0.1, X-Forwarded-For: 6.6.6.6)" in page
