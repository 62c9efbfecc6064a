"""Per-tenant first-token latency of one scheduler (the loop thread writes, ``snapshot`` may read from any).

Splits a slow first token into its parts: ``queue_seconds`` / ``queue_steps`` (arrival -> the step that
computed its first chunk began: the step in flight when it arrived, a prefetch, the queue) and
``ttft_seconds`` (arrival -> first token); their difference is the time of its own step(s).
"""

from __future__ import annotations

from collections import Counter

from cachecore.scheduler.request import Request


class FirstTokenStats:
    """Sums per tenant (one entry per tenant that had a first token: a bounded set)."""

    def __init__(self) -> None:
        self._by_owner: dict[str, Counter[str]] = {}

    def record(self, req: Request, ttft: float) -> None:
        """``req`` produced its first token ``ttft`` seconds after it arrived."""
        row = self._by_owner.setdefault(req.owner, Counter())
        row["first_tokens"] += 1
        row["queue_seconds"] += (req.started_time or req.arrival_time) - req.arrival_time
        row["queue_steps"] += (req.started_step or req.arrival_step) - req.arrival_step
        row["ttft_seconds"] += ttft

    def snapshot(self) -> dict[str, dict[str, float]]:
        # copies first: the loop thread may add a tenant or a key meanwhile
        return {owner: {k: round(v, 6) for k, v in list(row.items())} for owner, row in list(self._by_owner.items())}
