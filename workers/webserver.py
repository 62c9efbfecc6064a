"""The web process: uvicorn serving ``controlplane.asgi:application`` with Strata's connection limits
(``python -m workers.webserver``; ``make run`` and the compose ``web`` service start it).

Uvicorn alone bounds neither how long a client may take to send a request's line and headers nor its
body, and it has no header timeout at all (headers are read before the ASGI app sees anything), so
one client holding many half-sent requests could keep every connection slot. :class:`GuardedProtocol`
(uvicorn's httptools protocol) adds, per connection:

- a header timeout: the request line and headers must be complete within ``header_timeout`` seconds
  of the connection opening or of the first byte of the next request on a kept-alive connection;
  otherwise the connection is closed (nothing was parsed, so there is nobody to answer);
- a body timeout: once the headers are in, the whole body must arrive within ``body_timeout``
  seconds, however it trickles in; otherwise the client gets 408 (the JSON error shape) with
  ``Connection: close`` and the app is told the client disconnected (a response already started
  is cut by closing the connection).

Also: ``--limit-concurrency`` (connections and tasks; past it a request gets 503 with ``Retry-After``
in the JSON error shape); ``--max-connections-per-source``: one source (an IPv4 address or an IPv6
/64, the TCP peer: ``workers.connection_shares``) holds at most that many connections, so at most that
many half-sent requests, and its next connection is answered 429 ``too_many_connections`` and closed
as soon as it opens, uncounted (peers in ``STRATA_TRUSTED_PROXIES`` are not counted: a proxy caps its
clients itself); ``/healthz`` and ``/readyz`` (GET or HEAD, no body) are served past the cap, within
a reserve of :data:`HEALTH_RESERVE` running requests, so health checks keep answering while the cap
is full;
``--timeout-keep-alive`` and no proxy-header handling: uvicorn would otherwise rewrite the client
address from ``X-Forwarded-For`` of any peer in ``FORWARDED_ALLOW_IPS`` (127.0.0.1 by default), so a
local client could choose its source. ``controlplane.common.sources`` believes the header only from
``STRATA_TRUSTED_PROXIES``. Uvicorn's access log is off: the application writes its own, one JSON line
per request with its ``X-Request-Id`` (``controlplane.common.access_log``). Defaults come from
``strata_env.load`` (``STRATA_WEB_*``); flags override.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import strata_env
from workers.connection_shares import ConnectionShares

APP = "controlplane.asgi:application"
HEALTH_PATHS = frozenset({b"/healthz", b"/readyz"})
HEALTH_RESERVE = 8  # running requests past the cap that only health checks may use


def _error(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


async def over_capacity(scope, receive, send) -> None:
    """The app a request gets past the connection cap: 503, ``Retry-After``, connection closed."""
    body = _error("the server is at its connection limit; retry shortly", "service_unavailable_error",
                  "over_capacity")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def too_many_connections(share: int) -> bytes:
    """The whole response a connection past its source's share gets: 429, ``Retry-After``, closed."""
    body = _error(f"this address already holds {share} connections, its share of this server; close one "
                  "or retry shortly", "rate_limit_error", "too_many_connections")
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body))


class GuardedProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol with a header timeout, a body timeout and per-source connection
    shares (class attributes, set by :func:`guarded_protocol`; ``shares`` is shared by every
    connection of one server: None counts nothing)."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    shares: ConnectionShares | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._counted: str | None = None  # the address admitted into ``shares`` (released once)
        # The cap is checked here (same rule as uvicorn's) so that the 503 has Strata's JSON error shape.
        self._cap, self.limit_concurrency = self.limit_concurrency, None

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if self.shares is not None and address is not None:
            if not self.shares.admit(address):
                # Refused before it holds anything: out of the cap's count, no timers, closed once written.
                self.connections.discard(self)
                self.logger.warning("%s is over its share of %s connections: answering 429", address,
                                    self.shares.per_source)
                transport.write(too_many_connections(self.shares.per_source))
                transport.close()
                return
            self._counted = address
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._counted is not None and self.shares is not None:
            self.shares.release(self._counted)
            self._counted = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # the next request on a kept-alive connection starts arriving
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        app = self.app
        if self._over_cap():
            self.logger.warning("over the connection cap (%s): answering 503", self._cap)
            self.app = over_capacity
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out, self.cycle)

    def _over_cap(self) -> bool:
        """Uvicorn's rule (connections or running requests at the cap), except that a health check
        may run within :data:`HEALTH_RESERVE` requests past it: a GET or HEAD of a health path with
        no body, so it is complete and cannot be held open by trickling one."""
        if self._cap is None:
            return False
        if len(self.connections) < self._cap and len(self.tasks) < self._cap:
            return False
        return not (self._health_check() and len(self.tasks) < self._cap + HEALTH_RESERVE)

    def _health_check(self) -> bool:
        if self.parser.get_method() not in (b"GET", b"HEAD") or self.parser.should_upgrade():
            return False
        if httptools.parse_url(self.url).path not in HEALTH_PATHS:
            return False
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
                return False
        return True

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %s s", self.header_timeout)
            self.transport.close()

    def _body_timed_out(self, cycle) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        self.logger.info("answering 408: request body not complete within %s s", self.body_timeout)
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        self.loop.create_task(self._send_408(cycle))

    async def _send_408(self, cycle) -> None:
        body = _error(f"request body not received within {self.body_timeout:g} s", "invalid_request_error",
                      "body_timeout")
        try:
            await cycle.send({"type": "http.response.start", "status": 408, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            await cycle.send({"type": "http.response.body", "body": body})
        except RuntimeError:  # the app started its response meanwhile
            self.transport.close()
        finally:
            cycle.message_event.set()  # the app's pending receive() now reports a disconnect


def guarded_protocol(*, header_timeout: float, body_timeout: float,
                     shares: ConnectionShares | None = None) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass with these timeouts and these ``shares`` (uvicorn builds
    one instance per connection; every connection of the server counts in the same ``shares``)."""
    return type("StrataHttpProtocol", (GuardedProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout, "shares": shares})


def parse_args(argv: Sequence[str] | None = None, environ=None) -> argparse.Namespace:
    defaults = strata_env.load(environ)
    parser = argparse.ArgumentParser(prog="python -m workers.webserver", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--limit-concurrency", type=int, default=defaults.web_max_connections,
                        help="connections and tasks at once; past it: 503 (STRATA_WEB_MAX_CONNECTIONS)")
    parser.add_argument("--max-connections-per-source", type=int, default=None,
                        help="connections one source holds at once; past it: 429 (STRATA_WEB_MAX_CONNECTIONS_"
                             "PER_SOURCE, default a quarter of --limit-concurrency)")
    parser.add_argument("--timeout-keep-alive", type=int, default=defaults.web_keepalive_s,
                        help="close an idle kept-alive connection after this many seconds (STRATA_WEB_KEEPALIVE_S)")
    parser.add_argument("--timeout-header", type=float, default=defaults.web_header_timeout_s,
                        help="request line and headers within this many seconds (STRATA_WEB_HEADER_TIMEOUT_S)")
    parser.add_argument("--timeout-body", type=float, default=defaults.web_body_timeout_s,
                        help="the whole request body within this many seconds (STRATA_WEB_BODY_TIMEOUT_S)")
    parser.add_argument("--timeout-graceful-shutdown", type=int, default=5)
    parser.add_argument("--lifespan", default="off", choices=["auto", "on", "off"])
    parser.add_argument("--log-level", default=None)
    parser.set_defaults(trusted_proxies=defaults.trusted_proxies)  # STRATA_TRUSTED_PROXIES: not counted
    args = parser.parse_args(argv)
    for name in ("limit_concurrency", "timeout_keep_alive", "timeout_header", "timeout_body"):
        if not 0 < getattr(args, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_connections_per_source is None:  # the environment's share of this process's own cap
        try:
            args.max_connections_per_source = strata_env.web_share(environ, args.limit_concurrency)
        except strata_env.EnvError as exc:
            parser.error(str(exc))
    if not 0 < args.max_connections_per_source <= args.limit_concurrency:
        parser.error("--max-connections-per-source must be positive and at most --limit-concurrency")
    return args


def uvicorn_config(args: argparse.Namespace, app=APP):
    """The ``uvicorn.Config`` for ``args`` (tests build a server from it)."""
    import uvicorn

    return uvicorn.Config(
        app, host=args.host, port=args.port, lifespan=args.lifespan,
        http=guarded_protocol(header_timeout=args.timeout_header, body_timeout=args.timeout_body,
                              shares=ConnectionShares(args.max_connections_per_source, args.trusted_proxies)),
        # the access log is the application's (controlplane.common.access_log: JSON lines with the
        # request id, tenant, model, status and duration), so uvicorn's own is off
        proxy_headers=False, access_log=False, limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        log_level=args.log_level,
    )


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    uvicorn.Server(uvicorn_config(parse_args(argv))).run()


if __name__ == "__main__":
    main()
