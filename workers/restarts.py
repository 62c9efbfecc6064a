"""When a supervised child that died is started again: exponential backoff, and when it is a crash loop.

Pure bookkeeping (no processes, no clock of its own: callers pass ``time.monotonic()``), so the
policy is testable on its own. :class:`RestartPolicy` is the rule; :class:`RestartHistory` is one
child's record under it.

- Backoff: the n-th restart in a row waits ``base_s * 2**(n-1)`` seconds, at most ``cap_s``
  (1, 2, 4, 8, 16, 30, 30 ... by default). A child that ran at least ``stable_s`` before it died
  starts the series again at ``base_s``: one crash a day is not a loop.
- Crash loop: the child died more than ``max_restarts`` times within the last ``window_s`` seconds.
  Then it is not started again and the supervisor stops the platform.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    base_s: float = 1.0
    cap_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.cap_s < self.base_s:
            raise ValueError("backoff needs 0 < base_s <= cap_s")
        if self.max_restarts < 0 or self.window_s <= 0 or self.stable_s < 0:
            raise ValueError("max_restarts >= 0, window_s > 0 and stable_s >= 0 are required")

    def delay(self, in_a_row: int) -> float:
        """Seconds before the ``in_a_row``-th consecutive restart (1 = the first)."""
        return min(self.cap_s, self.base_s * 2 ** max(0, min(in_a_row - 1, 32)))


@dataclass
class RestartHistory:
    """One child's deaths under ``policy``: ``died`` answers how long to wait, or None (crash loop)."""

    policy: RestartPolicy
    in_a_row: int = 0  # consecutive short-lived runs (backoff exponent)
    deaths: deque[float] = field(default_factory=deque)  # monotonic times, within the window

    def died(self, now: float, uptime: float) -> float | None:
        """Record a death at ``now`` after ``uptime`` seconds of running; the backoff before the next
        start, or None when this death makes more than ``max_restarts`` within ``window_s``."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - self.policy.window_s:
            self.deaths.popleft()
        if len(self.deaths) > self.policy.max_restarts:
            return None
        self.in_a_row = 1 if uptime >= self.policy.stable_s else self.in_a_row + 1
        return self.policy.delay(self.in_a_row)

    def recent(self) -> int:
        """Deaths recorded within the window as of the last ``died``."""
        return len(self.deaths)
