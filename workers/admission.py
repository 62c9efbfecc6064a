"""Per-tenant admission and cancellation on a replica (both engines): the concurrent-request slots
that a tenant's streams and KV API calls share, and stopping requests (one by id, or every request of
a tenant that was suspended, offboarded or had its data key shredded).

:class:`RequestSlots` owns that state (slots taken per tenant, request key -> tenant, request key ->
why it was stopped, by its client or by the platform) under its own lock; its collaborators are the
replica's ``counters`` (``tenant_busy`` counted here) and ``holding(tenant)``, the engine's count of
the tenant's requests still holding blocks, which ``cancel_tenant`` waits on. A stream polls
``cancelled(key)`` every scheduler step (``should_abort``), so a cancel stops it at its next step
whether or not its client reads; it ends with ``stop_error(key)``: ``cancelled`` (499, its client
went away) or ``request_stopped`` (503, retryable: the platform stopped it while its client waits).
Plain Python (the web tier imports ``MAX_CONCURRENCY`` and the quota helpers from here).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cachecore.errors import CacheError, Cancelled, RequestStopped, TenantBusy
from workers.protocol import WorkerRequest, error_event
from workers.stops import apply_stops

MAX_CONCURRENCY = 32  # concurrent requests per actor (threads); the scheduler batches their forwards
DEFAULT_TENANT_CONCURRENCY = MAX_CONCURRENCY // 4
_CANCEL_MEMORY = 4096  # cancelled request ids remembered (a cancel may arrive before its request)
_KV_KEY = "kv:"  # slot keys of KV calls (request ids are hex)
CANCEL_TENANT_WAIT_S = 10.0  # how long cancel_tenant waits for the tenant's requests to release their blocks


def tenant_concurrency(limit) -> int:
    """A tenant's concurrent-request bound on one worker: ``None`` is the default (a quarter of the
    slots), anything else is taken as it is, so a quota of 0 runs nothing (never the default)."""
    return DEFAULT_TENANT_CONCURRENCY if limit is None else int(limit)


class RequestSlots:
    """The requests running on one replica, by tenant (module docstring). Thread-safe."""

    def __init__(self, *, counters: Counter[str], holding: Callable[[str], int]) -> None:
        self.counters = counters  # the replica's: ``tenant_busy`` is counted here
        self._holding = holding  # requests of a tenant the engine still runs (admitted or waiting)
        self._lock = threading.Lock()
        self._per_tenant: Counter[str] = Counter()  # slots taken per tenant (streams and KV calls)
        self._running: dict[str, str] = {}  # request key (request_id, or one of ours) -> tenant
        # request key -> why it was stopped, and whether by the platform (else its client went away)
        self._cancelled: OrderedDict[str, tuple[str, bool]] = OrderedDict()

    def admitted_stream(self, req: dict, serve) -> Iterator[dict]:
        """The stream of one request on this replica, whichever engine serves it: ``req`` read back as
        a ``WorkerRequest`` (a bad one is an ``invalid_request`` error event), one of its tenant's
        slots taken for it (``tenant_busy`` otherwise) and released at the end, and ``stop`` applied
        (``workers.stops``) to the events of ``serve(request, key)``, which returns them with the
        tokenizer that decodes them."""
        try:
            wr = WorkerRequest.from_dict(req)
        except ValueError as exc:
            yield error_event("invalid_request", str(exc), retryable=False)
            return
        key = wr.request_id or f"anon-{uuid.uuid4().hex}"
        try:
            self.acquire(wr.tenant, key, wr.max_concurrent_requests)
        except TenantBusy as exc:
            yield error_event(exc.code, str(exc), retryable=True)  # retryable on every engine
            return
        try:
            events, tokenizer = serve(wr, key)
            yield from apply_stops(events, tokenizer, wr.stop)
        finally:
            self.release(wr.tenant, key)

    def acquire(self, tenant: str, key: str, limit) -> None:
        """Take one of ``tenant``'s concurrent-request slots for the request ``key``, or raise
        ``TenantBusy`` (counted). ``limit``: the tenant's quota (``tenant_concurrency``)."""
        bound = tenant_concurrency(limit)
        with self._lock:
            busy = self._per_tenant[tenant] >= bound
            if not busy:
                self._per_tenant[tenant] += 1
                self._running[key] = tenant
        if busy:
            self.counters["tenant_busy"] += 1
            if bound <= 0:
                raise TenantBusy("this tenant's max_concurrent_requests quota is 0: it may run no requests")
            raise TenantBusy("this tenant already runs its limit of concurrent requests; retry shortly")

    def release(self, tenant: str, key: str) -> None:
        with self._lock:
            self._per_tenant[tenant] -= 1
            if not self._per_tenant[tenant]:
                del self._per_tenant[tenant]
            self._cancelled.pop(key, None)
            self._running.pop(key, None)

    @contextmanager
    def slot(self, req: dict) -> Iterator[None]:
        """A KV API call holds one of its tenant's concurrent-request slots while it runs (raises
        ``TenantBusy`` when they are all taken), like a completion does."""
        tenant, key = str(req["tenant"]), f"{_KV_KEY}{uuid.uuid4().hex}"
        self.acquire(tenant, key, req.get("max_concurrent_requests"))
        try:
            yield
        finally:
            self.release(tenant, key)

    def cancelled(self, key: str) -> str | None:
        """Why the request ``key`` was cancelled, or None while it may run (polled every step)."""
        marked = self._cancelled.get(key)
        return marked[0] if marked is not None else None

    def stop_error(self, key: str) -> CacheError | None:
        """What the stopped request ``key`` ends with: ``Cancelled`` when its client went away
        (nobody reads it), ``RequestStopped`` when the platform stopped it (its client still waits
        and may retry); None while it may run."""
        marked = self._cancelled.get(key)
        if marked is None:
            return None
        why, by_platform = marked
        return RequestStopped(why) if by_platform else Cancelled(why)

    def cancel(self, request_id: str) -> bool:
        """Stop the request ``request_id`` at its next chunk or token (its client went away); its
        blocks are released. Remembered for a while, so a cancel that overtakes its request works too.
        Returns whether such a request is running now."""
        with self._lock:
            self._mark_cancelled(str(request_id), "the request was cancelled", by_platform=False)
            return str(request_id) in self._running

    def _mark_cancelled(self, key: str, why: str, *, by_platform: bool) -> None:  # caller holds self._lock
        if key in self._cancelled and not by_platform:  # the platform's stop stands: its client may read it
            return
        self._cancelled[key] = (why, by_platform)
        while len(self._cancelled) > _CANCEL_MEMORY:
            self._cancelled.popitem(last=False)

    def cancel_tenant(self, tenant: str, *, reason: str = "", wait_seconds: float = CANCEL_TENANT_WAIT_S) -> dict:
        """Stop every running or waiting request of ``tenant`` on this replica (it was suspended,
        offboarded, or its data key shredded): each stops at its next step, and its stream ends with a
        retryable ``request_stopped`` error and no more tokens. Returns once their blocks are released or after
        ``wait_seconds``: ``{"cancelled": requests marked, "remaining": requests still holding
        blocks}`` (0 means done). Idempotent; requests that start after it returns are not affected
        (the control plane refuses them once the tenant's status changed)."""
        tenant = str(tenant)
        why = f"the request was stopped: {reason}" if reason else "the request was stopped by an operator"
        with self._lock:
            # KV calls last one lookup or copy and poll nothing: only streams are stopped
            keys = [k for k, t in self._running.items() if t == tenant and not k.startswith(_KV_KEY)]
            for k in keys:
                self._mark_cancelled(k, why, by_platform=True)
        deadline = time.monotonic() + wait_seconds
        while self._holding(tenant) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"cancelled": len(keys), "remaining": self._holding(tenant)}
