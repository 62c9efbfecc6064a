"""Weighted fair admission in front of an engine that batches whatever it is given (vLLM).

vLLM schedules the requests it holds first come, first served: a tenant that submits 30 requests at
once would have them all batched before another tenant's single request. ``FairGate`` keeps at most
``capacity`` requests inside the engine and, when a slot frees, gives it to the waiting tenant that
has received the least service per unit of ``share_weight`` (start-time fair queuing: each tenant
has a virtual time that grows by a request's cost over its weight when it is admitted; a tenant
that was idle starts at the gate's current virtual time, so it neither lost its turn nor banked
credit while away). Within one tenant requests start in arrival order. A tenant below its weighted
share therefore starts ahead of a tenant above it however many requests the latter queued, and
while one tenant is alone it may use every slot (work conserving).

Thread-safe; ``acquire`` blocks the calling thread (a Ray actor thread per request) until the
request is admitted, its ``should_stop`` returns True (cancelled: ``False`` is returned) or the
timeout passes (``TimeoutError``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable

POLL_S = 0.05  # how often a waiter re-checks should_stop


class FairGate:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = int(capacity)
        self._cond = threading.Condition()
        self._running: Counter[str] = Counter()
        self._weights: dict[str, int] = {}
        self._waiting: dict[int, tuple[str, float]] = {}  # ticket -> (tenant, cost)
        self._tickets = itertools.count()
        self._vt: dict[str, float] = {}  # tenant -> virtual start time of its next request
        self._clock = 0.0  # the virtual time of the last admission
        self.admitted = 0
        self.waited = 0  # admissions that had to wait for a slot

    @property
    def running(self) -> int:
        return sum(self._running.values())

    def running_of(self, tenant: str) -> int:
        return self._running[tenant]

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _next(self) -> int | None:
        """The ticket that gets the next free slot (caller holds the lock): the oldest ticket of the
        tenant with the smallest virtual time."""
        if not self._waiting or self.running >= self.capacity:
            return None
        first: dict[str, int] = {}
        for ticket, (tenant, _) in self._waiting.items():  # dicts keep insertion (arrival) order
            first.setdefault(tenant, ticket)
        return min(first.items(), key=lambda item: (self._vt.get(item[0], 0.0), item[1]))[1]

    def acquire(self, tenant: str, weight: int | None = None, *, cost: float = 1.0,
                should_stop: Callable[[], bool] = lambda: False, timeout: float | None = None) -> bool:
        """Wait for a slot for one request of ``tenant`` costing ``cost`` (e.g. its tokens); True
        when admitted, False when ``should_stop()`` became True first. ``release`` must follow an
        admission."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._weights[tenant] = max(1, int(weight or 1))
            if not self._running[tenant] and all(t != tenant for t, _ in self._waiting.values()):
                self._vt[tenant] = max(self._vt.get(tenant, 0.0), self._clock)  # back from idle
            ticket = next(self._tickets)
            self._waiting[ticket] = (tenant, max(float(cost), 1e-9))
            waited = False
            try:
                while self._next() != ticket:
                    waited = True
                    if should_stop():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("the engine stayed full")
                    self._cond.wait(POLL_S if left is None else min(POLL_S, left))
                self._running[tenant] += 1
                start = self._vt.get(tenant, 0.0)
                self._clock = max(self._clock, start)
                self._vt[tenant] = start + self._waiting[ticket][1] / self._weights[tenant]
                self.admitted += 1
                self.waited += waited
                return True
            finally:
                self._waiting.pop(ticket, None)
                self._cond.notify_all()

    def release(self, tenant: str) -> None:
        with self._cond:
            self._running[tenant] -= 1
            if self._running[tenant] <= 0:
                del self._running[tenant]
                if len(self._vt) > 4096:  # forget idle tenants' virtual times (they restart at the clock)
                    waiting = {t for t, _ in self._waiting.values()}
                    for t in [t for t in self._vt if t not in self._running and t not in waiting][:1024]:
                        del self._vt[t]
            self._cond.notify_all()

    def snapshot(self) -> dict:
        with self._cond:
            return {"capacity": self.capacity, "running": self.running, "waiting": len(self._waiting),
                    "admitted": self.admitted, "waited": self.waited,
                    "running_by_tenant": dict(self._running)}
