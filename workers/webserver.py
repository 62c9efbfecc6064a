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
in the JSON error shape),
``--timeout-keep-alive`` and no proxy-header handling: uvicorn would otherwise rewrite the client
address from ``X-Forwarded-For`` of any peer in ``FORWARDED_ALLOW_IPS`` (127.0.0.1 by default), so a
local client could choose its source. ``controlplane.common.sources`` believes the header only from
``STRATA_TRUSTED_PROXIES``. Defaults come from ``strata_env.load`` (``STRATA_WEB_*``); flags override.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import strata_env

APP = "controlplane.asgi:application"


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


class GuardedProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol with a header timeout and a body timeout (class attributes, set
    by :func:`guarded_protocol`)."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        # The cap is checked here (same rule as uvicorn's) so that the 503 has Strata's JSON error shape.
        self._cap, self.limit_concurrency = self.limit_concurrency, None

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
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
        if self._cap is not None and (len(self.connections) >= self._cap or len(self.tasks) >= self._cap):
            self.logger.warning("over the connection cap (%s): answering 503", self._cap)
            self.app = over_capacity
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out, self.cycle)

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


def guarded_protocol(*, header_timeout: float, body_timeout: float) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass with these timeouts (uvicorn builds one per connection)."""
    return type("StrataHttpProtocol", (GuardedProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


def parse_args(argv: Sequence[str] | None = None, environ=None) -> argparse.Namespace:
    defaults = strata_env.load(environ)
    parser = argparse.ArgumentParser(prog="python -m workers.webserver", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--limit-concurrency", type=int, default=defaults.web_max_connections,
                        help="connections and tasks at once; past it: 503 (STRATA_WEB_MAX_CONNECTIONS)")
    parser.add_argument("--timeout-keep-alive", type=int, default=defaults.web_keepalive_s,
                        help="close an idle kept-alive connection after this many seconds (STRATA_WEB_KEEPALIVE_S)")
    parser.add_argument("--timeout-header", type=float, default=defaults.web_header_timeout_s,
                        help="request line and headers within this many seconds (STRATA_WEB_HEADER_TIMEOUT_S)")
    parser.add_argument("--timeout-body", type=float, default=defaults.web_body_timeout_s,
                        help="the whole request body within this many seconds (STRATA_WEB_BODY_TIMEOUT_S)")
    parser.add_argument("--timeout-graceful-shutdown", type=int, default=5)
    parser.add_argument("--lifespan", default="off", choices=["auto", "on", "off"])
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)
    for name in ("limit_concurrency", "timeout_keep_alive", "timeout_header", "timeout_body"):
        if not 0 < getattr(args, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def uvicorn_config(args: argparse.Namespace, app=APP):
    """The ``uvicorn.Config`` for ``args`` (tests build a server from it)."""
    import uvicorn

    return uvicorn.Config(
        app, host=args.host, port=args.port, lifespan=args.lifespan,
        http=guarded_protocol(header_timeout=args.timeout_header, body_timeout=args.timeout_body),
        proxy_headers=False, limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        log_level=args.log_level,
    )


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    uvicorn.Server(uvicorn_config(parse_args(argv))).run()


if __name__ == "__main__":
    main()
