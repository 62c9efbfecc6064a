"""Where a request comes from: the one place that reads ``REMOTE_ADDR`` and ``X-Forwarded-For``.

The web server is started without proxy-header handling (``workers.webserver``), so ``REMOTE_ADDR``
is always the TCP peer. ``X-Forwarded-For`` is believed only when that peer is one of
``settings.STRATA_TRUSTED_PROXIES`` (empty by default: then the peer is the source, whatever the
header says). Behind trusted proxies the source is the right-most address of the chain that is not a
trusted proxy itself: each proxy appends the address it saw, so everything left of that entry was
written by the client and may be forged.

Throttling and the audit log both use :func:`request_source`; audit events record the chosen
``source``, the ``peer`` and the ``forwarded_for`` chain as received (capped), so a forged or
surprising chain stays visible.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from django.conf import settings
from django.http import HttpRequest

ADDRESS_MAX = 64  # AuditEvent.source / .peer
CHAIN_MAX = 255  # AuditEvent.forwarded_for
HOPS_MAX = 32  # a longer chain is cut (its left, client-written end): bounded work per request

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class RequestSource:
    """``source``: the address throttled and audited; ``peer``: the TCP peer; ``forwarded_for``: the
    ``X-Forwarded-For`` header as received ("" when absent), whether believed or not."""

    source: str
    peer: str
    forwarded_for: str = ""


@functools.lru_cache(maxsize=8)
def _networks(configured: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(item, strict=False) for item in configured)


def _parse(entry: str) -> Address | None:
    """An address from one chain entry: ``1.2.3.4``, ``1.2.3.4:5678``, ``2001:db8::1``,
    ``[2001:db8::1]:443``; ``None`` for anything else (``unknown``, obfuscated identifiers, junk)."""
    entry = entry.strip().strip('"')
    if entry.startswith("["):
        entry = entry[1:].partition("]")[0]
    elif entry.count(":") == 1:
        entry = entry.partition(":")[0]
    try:
        address = ipaddress.ip_address(entry)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _trusted(address: Address | None, networks: tuple[Network, ...]) -> bool:
    return address is not None and any(address in network for network in networks)


def request_source(request: HttpRequest) -> RequestSource:
    """The request's :class:`RequestSource` (see the module docstring for the rule)."""
    peer = (request.META.get("REMOTE_ADDR") or "")[:ADDRESS_MAX]
    raw = request.META.get("HTTP_X_FORWARDED_FOR") or ""
    chain = raw[:CHAIN_MAX]
    networks = _networks(tuple(getattr(settings, "STRATA_TRUSTED_PROXIES", ())))
    if not raw or not _trusted(_parse(peer), networks):
        return RequestSource(source=peer, peer=peer, forwarded_for=chain)
    hops = raw.split(",")[-HOPS_MAX:]
    source = peer
    for entry in reversed(hops):
        address = _parse(entry)
        if address is None:
            break  # not an address a proxy of ours wrote: stop at the last hop we can vouch for
        source = str(address)
        if not _trusted(address, networks):
            break
    return RequestSource(source=source[:ADDRESS_MAX], peer=peer, forwarded_for=chain)


def peer_trusted(peer: str) -> bool:
    """Whether the TCP peer ``peer`` is one of ``settings.STRATA_TRUSTED_PROXIES`` (whose headers
    about the client, such as ``X-Request-Id``, are believed)."""
    networks = _networks(tuple(getattr(settings, "STRATA_TRUSTED_PROXIES", ())))
    return bool(networks) and _trusted(_parse(peer or ""), networks)
