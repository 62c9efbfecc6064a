"""Each source's share of one web process's connections (``workers.webserver``).

A *source* is a TCP peer bucketed the way Strata's throttles bucket it
(``controlplane.common.throttle.source_bucket``): an IPv4 address, or the /64 of an IPv6 address
(one host commonly holds a whole /64); an IPv4-mapped IPv6 address is its IPv4 address. The web
server counts connections before any request is parsed, so the source here is always the peer:
``X-Forwarded-For`` does not exist yet.

:class:`ConnectionShares` is bookkeeping only (no sockets, no event loop): the protocol asks
:meth:`~ConnectionShares.admit` when a connection opens and calls :meth:`~ConnectionShares.release`
when an admitted one closes. A source holds at most ``per_source`` connections at once, and so at most
that many half-sent requests (a request being sent holds its connection). Peers in ``exempt`` (the
trusted proxies, ``STRATA_TRUSTED_PROXIES``) are admitted and never counted: a proxy carries many
clients' connections, and must cap them per client itself (the README's "Behind a proxy").

Memory is bounded by the connections open: a source's entry goes when its last connection closes.
One event loop owns an instance (uvicorn's, one per web process); it is not thread-safe.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def source_of(address: str) -> str:
    """The source ``address`` belongs to: the IPv4 address itself, an IPv6 address's /64 (IPv4-mapped:
    the IPv4 address), anything that is not an address (a Unix socket's name) as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class ConnectionShares:
    """Connections held per source, each source bounded by ``per_source`` (>= 1).

    - :meth:`admit` counts a new connection and returns True, or returns False (and counts
      nothing) when its source already holds ``per_source``; an exempt peer is always admitted,
      uncounted.
    - :meth:`release` uncounts one admitted connection; call it once per True :meth:`admit`, with
      the same address (releasing an exempt peer, or a source holding nothing, is a no-op).
    - :meth:`held` reads a source's count; :meth:`check_integrity` raises AssertionError when the
      counts are not all within 1..``per_source`` (tests call it after each step).
    """

    def __init__(self, per_source: int, exempt: Iterable[str] = ()) -> None:
        if per_source < 1:
            raise ValueError(f"per_source must be >= 1, got {per_source}")
        self.per_source = per_source
        self._exempt: tuple[Network, ...] = tuple(ipaddress.ip_network(item, strict=False) for item in exempt)
        self._held: dict[str, int] = {}

    def exempt(self, address: str) -> bool:
        """True when ``address`` is a trusted proxy (never counted)."""
        if not self._exempt:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self._exempt)

    def admit(self, address: str) -> bool:
        if self.exempt(address):
            return True
        source = source_of(address)
        held = self._held.get(source, 0)
        if held >= self.per_source:
            return False
        self._held[source] = held + 1
        return True

    def release(self, address: str) -> None:
        if self.exempt(address):
            return
        source = source_of(address)
        held = self._held.get(source, 0)
        if held <= 1:
            self._held.pop(source, None)
        else:
            self._held[source] = held - 1

    def held(self, address: str) -> int:
        """Connections counted for ``address``'s source now."""
        return self._held.get(source_of(address), 0)

    def check_integrity(self) -> None:
        for source, held in self._held.items():
            assert 1 <= held <= self.per_source, f"{source} holds {held} (share {self.per_source})"
