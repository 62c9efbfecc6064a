"""Who goes next: a fair queue between tenants, cache-aware ordering with aging within a tenant.

Between tenants, start-time fair queuing over computed tokens (``FairQueue``): each tenant has a
virtual time that grows by the tokens the model computed for it (prefill chunks and decode tokens)
divided by its weight; the next chunk goes to the backlogged tenant with the smallest virtual time. A
tenant that was idle starts at most ``quantum`` tokens (divided by its weight) behind the virtual
time of the last chunk granted, so it banks at most one quantum of credit (as a deficit round robin
flow's first quantum): a light tenant's short request goes ahead of a bursting tenant's queue as a
whole, and a tenant bursting many requests is served its share, not everyone's.

Within a tenant (``order_key``), the ``cache_aware`` policy serves the request with the longest cached
prefix first (what the scheduler's ``CachedPrefixes`` says the cache holds, so requests sharing a prefix
follow the one that computes it) and groups requests by their first block; ``fcfs`` serves in arrival
order. Aging bounds the wait under either: a request that waited ``age_steps`` scheduler steps is
overdue and goes before every non-overdue request of every tenant, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict

from cachecore.scheduler.request import Request

QUEUE_POLICIES = ("cache_aware", "fcfs")


class FairQueue:
    """Virtual times of tenants (not thread-safe: the loop thread's)."""

    def __init__(self, quantum: float = 0.0) -> None:
        if not quantum >= 0:
            raise ValueError(f"quantum must be >= 0, got {quantum!r}")
        self.quantum = float(quantum)
        self._vtime: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._now = 0.0  # virtual time of the last chunk granted

    def set_weight(self, owner: str, weight: float) -> None:
        """Share of ``owner`` relative to others (default 1). Raises ``ValueError`` unless > 0."""
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight!r}")
        self._weights[owner] = float(weight)

    def weight(self, owner: str) -> float:
        return self._weights.get(owner, 1.0)

    def activate(self, owner: str) -> None:
        """``owner`` has work again: it starts no earlier than one quantum before the current virtual
        time (no-op while it is backlogged: its virtual time stands)."""
        start = self._now - self.quantum / self.weight(owner)
        self._vtime[owner] = max(self._vtime.get(owner, start), start)

    def vtime(self, owner: str) -> float:
        return self._vtime.get(owner, self._now)

    def grant(self, owner: str) -> None:
        """A chunk of ``owner`` was picked: the system virtual time advances to its virtual time."""
        self._now = max(self._now, self.vtime(owner))

    def charge(self, owner: str, tokens: int) -> None:
        """The model computed ``tokens`` for ``owner``."""
        self._vtime[owner] = self.vtime(owner) + tokens / self.weight(owner)

    def forget_idle(self, active: set[str]) -> None:
        """Drop state of tenants without work (their virtual time restarts at ``now`` anyway)."""
        for owner in [o for o in self._vtime if o not in active and self._vtime[o] <= self._now]:
            del self._vtime[owner]


class CachedPrefixes:
    """Block hashes the scheduler saw committed (bounded LRU): an estimate of what L1 holds, used
    only to order and group waiting requests and to decide when re-admitting finds a longer hit.
    Never trusted for correctness (admission checks the real cache)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def prefix_blocks(self, hashes: list[bytes], limit: int) -> int:
        """Leading blocks of ``hashes`` (at most ``limit``) that were committed."""
        n = 0
        for h in hashes[:limit]:
            if h not in self._hashes:
                break
            n += 1
        return n


def cached_estimate(req: Request, index: CachedPrefixes, block_size: int) -> int:
    """Tokens of ``req``'s prompt the cache likely holds: what its admission holds or loads, or the
    committed prefix the index knows, whichever is longer (the last token is never cached)."""
    seq = req.seq
    held = 0
    if seq is not None:
        held = seq.num_cached_tokens + len(seq.load_blocks) * block_size
        hashes = seq.hashes
    else:
        hashes = req.extra.get("hashes", [])
    limit = (len(req.tokens) - 1) // block_size
    return max(held, index.prefix_blocks(hashes, limit) * block_size)


def is_overdue(req: Request, step: int, age_steps: int) -> bool:
    return step - req.requeued_step >= age_steps


def order_key(req: Request, *, step: int, age_steps: int, policy: str, index: CachedPrefixes,
              block_size: int) -> tuple:
    """Sort key of a waiting request within its tenant (smaller goes first)."""
    if is_overdue(req, step, age_steps):
        return (0, req.rid)
    if policy == "fcfs":
        return (1, req.requeued_step, req.rid)
    hashes = req.seq.hashes if req.seq is not None else req.extra.get("hashes", [])
    group = hashes[0] if hashes else b""
    return (1, -cached_estimate(req, index, block_size), group, req.requeued_step, req.rid)
