"""The bounded pool where the serving API parses bodies, renders chat templates and tokenizes.

That work is CPU-bound and its cost follows the request. On the event loop it would stall every
connection; run the way Django runs sync code (a thread per request) a tenant's concurrent requests
would all render at once, each contending for the GIL with everything else. Here
``STRATA_RENDER_THREADS`` threads serve every tenant; one tenant runs on at most all but one of them
(``per_tenant``), its further jobs wait (without a thread) for its own turn, and at most
``MAX_WAITING`` of them wait at once: past that it gets 429 ``render_busy``. So one tenant's renders
cannot hold every thread, and another tenant's request always finds one within one job.

A job's own cost is bounded by the job (``cachecore.model.template_guard`` budgets, bodies bounded
by size first): threads cannot be killed, so a job whose client went away still runs to its end and
keeps its tenant's slot until then.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from django.conf import settings

from controlplane.common.errors import RateLimited

T = TypeVar("T")
MAX_WAITING = 32  # jobs of one tenant waiting for a thread before it gets 429


class RenderPool:
    """``await pool.run(tenant, fn, *args)`` runs ``fn(*args)`` on one of ``threads`` threads, at most
    ``per_tenant`` of them for one tenant at a time. One pool per event loop (its waits are the loop's);
    ``executor`` may be shared between pools."""

    def __init__(self, executor: ThreadPoolExecutor, threads: int) -> None:
        self.executor = executor
        self.per_tenant = max(1, threads - 1)
        self._slots: dict[Any, asyncio.Semaphore] = {}
        self._users: dict[Any, int] = {}  # jobs of each tenant running or waiting here

    async def run(self, tenant: Any, fn: Callable[..., T], *args: Any) -> T:
        users = self._users.get(tenant, 0)
        if users >= self.per_tenant + MAX_WAITING:
            raise RateLimited("too many of this tenant's requests are waiting to be parsed and tokenized",
                              retry_after=1, code="render_busy")
        slot = self._slots.get(tenant)
        if slot is None:
            slot = self._slots[tenant] = asyncio.Semaphore(self.per_tenant)
        self._users[tenant] = users + 1
        released = False
        try:
            await slot.acquire()
            future: Future = self.executor.submit(fn, *args)
            loop = asyncio.get_running_loop()
            released = True  # from here the slot is released when the job ends, not when this call does
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, tenant, slot))
            return await asyncio.wrap_future(future)
        finally:
            if not released:  # cancelled while waiting for its turn
                self._forget(tenant)

    def _release(self, tenant: Any, slot: asyncio.Semaphore) -> None:
        slot.release()
        self._forget(tenant)

    def _forget(self, tenant: Any) -> None:
        left = self._users[tenant] - 1
        if left:
            self._users[tenant] = left
        else:  # nobody of this tenant is here: keep the tables as small as the set of active tenants
            del self._users[tenant]
            self._slots.pop(tenant, None)

    def busy(self, tenant: Any) -> int:
        """Jobs of ``tenant`` running or waiting in this pool."""
        return self._users.get(tenant, 0)


_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RenderPool] = weakref.WeakKeyDictionary()


def pool() -> RenderPool:
    """This event loop's pool over the process's ``STRATA_RENDER_THREADS`` threads."""
    global _executor
    loop = asyncio.get_running_loop()
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(settings.STRATA_RENDER_THREADS, thread_name_prefix="strata-render")
        found = _pools.get(loop)
        if found is None:
            found = _pools[loop] = RenderPool(_executor, settings.STRATA_RENDER_THREADS)
        return found


async def run(tenant: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in the render pool, counted against ``tenant``'s share."""
    return await pool().run(tenant, fn, *args)
