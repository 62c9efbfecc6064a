"""The serving path's database work, on threads that keep their database connections.

Under ASGI Django runs each request's sync code in a thread of its own (``ThreadSensitiveContext``),
so every request opened a new connection (SQLite: the file, its pragmas, Django's functions) and
closed it at its end: most of the admission's cost (``bench.api_overhead``). Here at most
``STRATA_SERVING_DB_THREADS`` threads serve every request's admission and preparation; each keeps its
connection from one job to the next. No request signal ever runs in them, so Django never closes
those connections; a job closes its own thread's connection when it saw a database error, left a
transaction open, or the database has a connection pool (PostgreSQL: taking one from the pool costs
no new connection, and a connection held outside it could keep a database from being dropped).

``run(fn, *args)`` is the hop; a request that did not come through the ASGI server (WSGI, Django's
test client: its data may sit in the caller's transaction) keeps Django's own thread for its request
(``for_request``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

T = TypeVar("T")
DEFAULT_THREADS = 8

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def executor() -> ThreadPoolExecutor:
    """The process's serving database threads (created on first use; threads start as jobs need them)."""
    global _executor
    with _lock:
        if _executor is None:
            threads = int(getattr(settings, "STRATA_SERVING_DB_THREADS", DEFAULT_THREADS))
            _executor = ThreadPoolExecutor(max(1, threads), thread_name_prefix="strata-serving-db")
        return _executor


def _pooled() -> bool:
    return bool(connection.settings_dict.get("OPTIONS", {}).get("pool"))


def _job(fn: Callable[..., T]) -> Callable[..., T]:
    def job(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            if connection.connection is not None and (
                    connection.errors_occurred or connection.in_atomic_block or not connection.get_autocommit()
                    or _pooled()):
                connection.close()  # reopened by the next job that needs it

    return job


async def run(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on one of the serving database threads."""
    return await sync_to_async(_job(fn), thread_sensitive=False, executor=executor())(*args)


async def for_request(request: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` for ``request``: on the serving database threads when the request came through the
    ASGI server's gate (``serving.gate``: admitted there, or its admission deferred to ``fn``), else in
    Django's thread for the request (thread-sensitive), where a caller's open transaction is visible."""
    from controlplane.serving.admission import gated

    if gated(request):
        return await run(fn, *args)
    return await sync_to_async(fn, thread_sensitive=True)(*args)
