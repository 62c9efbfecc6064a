"""Long-lived threads for Django's own thread-sensitive steps of the requests the gate admits.

Django's ASGI handler runs each request in a ``ThreadSensitiveContext`` of its own: the first
thread-sensitive step (``request_started``'s receivers) starts a new thread, and the event loop waits
for that thread to start (most of a millisecond on a busy machine, ``bench.api_overhead``'s profile),
then tears it down after ``response.close``. The gate's requests run instead in a context over one of
``LANES`` single-thread executors that live as long as the process (asgiref's
``ThreadSensitiveContext(executor=...)``; Django's own context, nested, is then a no-op).

What runs there is Django's per-request bookkeeping (``request_started``, ``response.close`` with
``request_finished``) when a receiver other than Django's own is connected (otherwise
``controlplane.asgi.ServingASGIHandler`` runs those on the event loop, with no hop), and any other
thread-sensitive step; none of the serving path's database work (``db_threads``), so one request's
step never waits long behind another's in its lane. Requests take the lanes in turn.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext

LANES = 4

_lock = threading.Lock()
_executors: list[ThreadPoolExecutor] = []
_turn = itertools.count()


def _lanes() -> list[ThreadPoolExecutor]:
    with _lock:
        if not _executors:
            _executors.extend(ThreadPoolExecutor(1, thread_name_prefix=f"strata-serving-lane-{i}")
                              for i in range(LANES))
        return _executors


def context() -> ThreadSensitiveContext:
    """A thread-sensitive context for one request, over the next lane (enter it once)."""
    lanes = _lanes()
    return ThreadSensitiveContext(executor=lanes[next(_turn) % len(lanes)])
