"""A circuit breaker: stop calling a dependency that just failed, for a while, then try it again.

Generic: it knows nothing of what is called (L3 uses one in front of its backend so that a dead
store does not cost every request a timeout); the caller asks :meth:`CircuitBreaker.allow` before a
call and reports the outcome with :meth:`~CircuitBreaker.record_failure` or
:meth:`~CircuitBreaker.record_success`.

States:

- ``closed``: every call is allowed; ``failure_threshold`` consecutive failures open the breaker (a
  success in between starts the count again);
- ``open``: no call is allowed until ``cooldown_seconds`` after the last failure (a failure reported
  while open, by a call that started before it opened, re-arms the cooldown);
- ``half_open``: the cooldown has passed; calls are allowed again (every caller, no trial quota), the
  first success closes the breaker and a failure opens it again at once, whatever the threshold.

Time is ``clock`` (``time.monotonic`` by default). Thread-safe: one lock, held only for a few
assignments.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "CircuitBreaker"]

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    """See the module doc. ``failure_threshold``: consecutive failures that open a closed breaker (an
    int >= 1); ``cooldown_seconds``: how long an open breaker refuses calls (>= 0; readable and
    settable as an attribute, taking effect at the next failure)."""

    def __init__(
        self,
        *,
        failure_threshold: int = 1,
        cooldown_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, got {failure_threshold!r}")
        self.failure_threshold = failure_threshold
        self.cooldown_seconds = cooldown_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0  # consecutive failures while closed
        self._open_until = 0.0  # clock() before which an open breaker refuses calls
        self.opened = 0  # times the breaker opened (closed or half-open -> open)

    @property
    def cooldown_seconds(self) -> float:
        return self._cooldown

    @cooldown_seconds.setter
    def cooldown_seconds(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
            raise ValueError(f"cooldown_seconds must be a number >= 0, got {seconds!r}")
        self._cooldown = seconds

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open`` (an open breaker whose cooldown has passed reads
        ``half_open``)."""
        with self._lock:
            self._lapse()
            return self._state

    @property
    def failures(self) -> int:
        """Consecutive failures counted while closed."""
        with self._lock:
            return self._failures

    def allow(self) -> bool:
        """Whether a call may go ahead now (False only while open)."""
        with self._lock:
            self._lapse()
            return self._state != OPEN

    def record_failure(self) -> None:
        """A call failed: counted while closed (opens at the threshold); opens a half-open breaker;
        re-arms an open one's cooldown."""
        with self._lock:
            self._lapse()
            if self._state == CLOSED:
                self._failures += 1
                if self._failures < self.failure_threshold:
                    return
            if self._state != OPEN:
                self.opened += 1
            self._state = OPEN
            self._failures = 0
            self._open_until = self.clock() + self._cooldown

    def record_success(self) -> None:
        """A call succeeded: closes a half-open breaker, resets a closed one's failure count. Ignored
        while open (a call that started before the breaker opened says nothing of now)."""
        if self._state == CLOSED and self._failures == 0:  # the common case, without the lock
            return
        with self._lock:
            self._lapse()
            if self._state != OPEN:
                self._state = CLOSED
                self._failures = 0

    def reset(self) -> None:
        """Closed, no failures counted."""
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._open_until = 0.0

    def _lapse(self) -> None:
        """Open -> half-open once the cooldown has passed (under the lock)."""
        if self._state == OPEN and self.clock() >= self._open_until:
            self._state = HALF_OPEN

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.state}, threshold={self.failure_threshold}, cooldown={self._cooldown}s)"
