"""Each source's share of the web server's connections, as bookkeeping (``workers.connection_shares``)
and as a setting (``STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE``). The share over real sockets is pinned
in ``tests/test_webserver.py``."""

from __future__ import annotations

import pytest

import strata_env
from controlplane.common.throttle import source_bucket
from workers import webserver
from workers.connection_shares import ConnectionShares, source_of

ADDRESSES = ["10.0.0.1", "2001:db8::1", "2001:db8::ffff:1", "2001:db8:0:1::1", "::ffff:10.0.0.1", "unix:x", ""]


@pytest.mark.parametrize("address", ADDRESSES)
def test_a_source_is_what_the_throttles_call_one(address):
    assert source_of(address) == source_bucket(address)


def test_a_source_past_its_share_is_refused_and_others_are_not():
    shares = ConnectionShares(2)
    assert shares.admit("10.0.0.1") and shares.admit("10.0.0.1")
    assert not shares.admit("10.0.0.1")  # its third
    assert shares.held("10.0.0.1") == 2  # the refused one is not counted
    assert shares.admit("10.0.0.2")  # another source has its own share
    shares.check_integrity()


def test_a_closed_connection_gives_its_slot_back_and_an_idle_source_is_forgotten():
    shares = ConnectionShares(1)
    assert shares.admit("10.0.0.1")
    shares.release("10.0.0.1")
    assert shares.admit("10.0.0.1")
    shares.release("10.0.0.1")
    assert shares.held("10.0.0.1") == 0 and shares._held == {}
    shares.release("10.0.0.1")  # nothing held: a no-op, never negative
    assert shares.held("10.0.0.1") == 0
    shares.check_integrity()


def test_one_ipv6_slash_64_is_one_source_and_the_next_is_another():
    shares = ConnectionShares(2)
    assert shares.admit("2001:db8::1") and shares.admit("2001:db8::ffff:2")
    assert not shares.admit("2001:db8::3")  # same /64: a host choosing new addresses gains nothing
    assert shares.admit("2001:db8:0:1::1")  # the next /64


def test_an_ipv4_mapped_peer_counts_as_its_ipv4_address():
    shares = ConnectionShares(1)
    assert shares.admit("10.0.0.1")
    assert not shares.admit("::ffff:10.0.0.1")


def test_trusted_proxies_are_never_counted_and_other_peers_are():
    shares = ConnectionShares(1, exempt=("10.1.0.0/16",))
    assert all(shares.admit("10.1.2.3") for _ in range(5))
    assert shares.held("10.1.2.3") == 0
    assert shares.admit("10.2.0.1") and not shares.admit("10.2.0.1")


def test_a_share_below_one_is_refused():
    with pytest.raises(ValueError):
        ConnectionShares(0)


# ---------------------------------------------------------------------------------------- the setting
def test_the_share_defaults_to_a_quarter_of_the_cap():
    assert strata_env.load({}).web_max_connections_per_source == 128
    assert strata_env.load({"STRATA_WEB_MAX_CONNECTIONS": "100"}).web_max_connections_per_source == 25
    assert strata_env.load({"STRATA_WEB_MAX_CONNECTIONS": "2"}).web_max_connections_per_source == 1
    explicit = {"STRATA_WEB_MAX_CONNECTIONS": "100", "STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE": "10"}
    assert strata_env.load(explicit).web_max_connections_per_source == 10


@pytest.mark.parametrize("value", ["0", "-1", "x", "513"])
def test_a_share_not_within_one_and_the_cap_names_the_variable(value):
    with pytest.raises(strata_env.EnvError, match="STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE"):
        strata_env.load({"STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE": value})


def test_the_web_server_takes_the_share_of_its_own_cap():
    args = webserver.parse_args(["--limit-concurrency", "40"], environ={})
    assert args.max_connections_per_source == 10
    args = webserver.parse_args(["--limit-concurrency", "40", "--max-connections-per-source", "40"], environ={})
    assert args.max_connections_per_source == 40
    with pytest.raises(SystemExit):
        webserver.parse_args(["--limit-concurrency", "40", "--max-connections-per-source", "41"], environ={})
    with pytest.raises(SystemExit):
        webserver.parse_args(["--max-connections-per-source", "0"], environ={})
    config = webserver.uvicorn_config(webserver.parse_args([], environ={"STRATA_TRUSTED_PROXIES": "10.1.0.0/16"}))
    assert config.http.shares.exempt("10.1.2.3") and not config.http.shares.exempt("10.2.0.1")
