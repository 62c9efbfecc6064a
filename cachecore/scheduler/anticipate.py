"""Anticipation: a short hold before the next step for a tenant below its share that just finished a request.

A request that arrives mid-step waits for the step in flight, and a client that sends its requests one
after another (a chat, an agent loop, the victim of ``bench.flood``) always arrives just after the next
step began: its request finished at the end of one step, the loop started the flooder's next step at
once, and the follow-up landed in it. So when a request of a tenant below its share (behind every other
tenant with work in virtual time) finishes and that tenant has nothing else queued, the loop holds the
next step for at most ``hold_s`` seconds, until that tenant's next request arrives (anticipatory
scheduling, as in Iyer and Druschel's anticipatory disk scheduler). The cost is bounded: one hold per
such finished request, at most ``hold_s`` of idle device each; a tenant at or above its share never
causes one, so a flooder cannot buy idle time with its own requests.

Engine-independent; the loop (``loop.py``) calls ``finished`` from its thread and ``take`` before waiting.
"""

from __future__ import annotations

from collections.abc import Mapping


class Anticipation:
    """At most one expected tenant at a time (not thread-safe: the loop thread's)."""

    def __init__(self, hold_s: float) -> None:
        if isinstance(hold_s, bool) or not isinstance(hold_s, int | float) or not 0 <= hold_s <= 1:
            raise ValueError(f"hold must be between 0 and 1 second, got {hold_s!r}")
        self.hold_s = float(hold_s)
        self._expected: str | None = None

    def finished(self, owner: str, *, busy: bool, vtime: float, others: Mapping[str, float]) -> None:
        """A request of ``owner`` finished; ``busy``: it has other requests queued or running;
        ``others``: virtual times of the other tenants with work. Expect ``owner`` back when it was below
        all of them and has nothing else to do."""
        if self.hold_s > 0 and not busy and others and vtime < min(others.values()):
            self._expected = owner
        elif self._expected == owner:
            self._expected = None

    def take(self) -> tuple[str, float] | None:
        """``(owner, seconds)`` to hold the next step for, once per expectation; None when none."""
        owner, self._expected = self._expected, None
        return None if owner is None else (owner, self.hold_s)
