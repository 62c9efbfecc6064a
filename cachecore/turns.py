"""FairTurns: one model forward at a time, handed out fairly among tenants.

A worker runs many requests on one model; without batching, forwards are serialised. A plain lock
lets whoever grabs it first go next, so a tenant with many concurrent streams (or long prompts) takes
most turns and delays everyone else's first token. ``FairTurns`` is start-time fair queuing over
owners: each owner has a virtual time that grows by the seconds its turns took (divided by its
weight); the next turn goes to the waiting owner with the smallest virtual time (ties: first come).
An owner that was idle starts at the current system virtual time, so it cannot bank credit.

Together with chunked prefill (``Generator(prefill_chunk=...)``) this bounds how long a light request
waits behind a heavy tenant: about one chunk, not the heavy tenant's whole queue.

Thread-safe. Turns are not re-entrant.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class FairTurns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._vtime: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._now = 0.0  # virtual time of the turn last granted
        self._waiting: dict[int, str] = {}  # ticket -> owner
        self._tickets = itertools.count()
        self.turns_granted = 0

    def set_weight(self, owner: str, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight!r}")
        with self._cond:
            self._weights[owner] = float(weight)

    @contextmanager
    def turn(self, owner: str) -> Iterator[None]:
        """Block until ``owner`` is granted the model, hold it for the ``with`` body, then account the
        time it took against ``owner``."""
        ticket = next(self._tickets)
        with self._cond:
            self._vtime[owner] = max(self._vtime.get(owner, 0.0), self._now)
            self._waiting[ticket] = owner
            while self._busy or self._next() != ticket:
                self._cond.wait()
            del self._waiting[ticket]
            self._busy = True
            self._now = self._vtime[owner]
            self.turns_granted += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            with self._cond:
                self._vtime[owner] += elapsed / self._weights.get(owner, 1.0)
                self._busy = False
                self._cond.notify_all()

    def _next(self) -> int:
        return min(self._waiting, key=lambda t: (self._vtime[self._waiting[t]], t))

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)
