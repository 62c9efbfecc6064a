"""Prefixes the router dispatched that no replica has cached yet: its own in-flight requests.

The router's index learns a block only when the replica reports it stored, after the prefill that
computes it. A request that reuses the prefix of one still waiting or prefilling finds no hit
anywhere, although the replica serving that earlier request will hold the prefix by the time a
request queued behind it starts: a replica prefills first come first served, so a request sent
after another to the same replica starts after that one ended and was cached. SGLang's router and
vLLM production-stack's prefix router insert a request's prefix into their approximate trees when
they route it, for the same reason; Dynamo's router does when it runs without KV events.

``InFlight`` keeps, per replica, the block keys of the requests dispatched there that are still in
its queue. In FCFS order those are the last ``queued_requests`` dispatched (the replica's reported
queue, the one being prefilled included), so ``trim`` forgets the older ones: they were prefilled
and the index knows their blocks, or they were evicted since, which the index knows too. No clock
and no guessed expiry. ``match`` is the longest prefix of a request's blocks held by a replica's
in-flight requests. Keys are whatever the index keys blocks by (chain hashes, in which a key stands
for its whole prefix). Not thread-safe: the policy that owns it is serialised by its router.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Sequence

__all__ = ["InFlight"]


class InFlight:
    """Per replica: the block keys of its dispatched, not yet prefilled requests (module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[tuple[Hashable, ...]]] = {}
        self._keys: dict[str, Counter[Hashable]] = {}

    def add(self, replica_id: str, blocks: Sequence[Hashable]) -> None:
        """A request with these full-block keys was dispatched to ``replica_id`` (newest last)."""
        self._queues.setdefault(replica_id, deque()).append(tuple(blocks))
        self._keys.setdefault(replica_id, Counter()).update(blocks)

    def trim(self, replica_id: str, queued_requests: int) -> None:
        """Keep only the ``queued_requests`` newest dispatches to ``replica_id`` (0: forget all)."""
        queue = self._queues.get(replica_id)
        if queue is None:
            return
        keys = self._keys[replica_id]
        while len(queue) > max(0, queued_requests):
            for key in queue.popleft():
                left = keys[key] - 1
                if left > 0:
                    keys[key] = left
                else:
                    del keys[key]
        if not queue:
            del self._queues[replica_id], self._keys[replica_id]

    def forget(self, replica_id: str) -> None:
        """Drop everything dispatched to ``replica_id`` (it died or left)."""
        self._queues.pop(replica_id, None)
        self._keys.pop(replica_id, None)

    def match(self, replica_id: str, blocks: Sequence[Hashable]) -> int:
        """How many leading ``blocks`` the replica's in-flight requests hold."""
        keys = self._keys.get(replica_id)
        if not keys:
            return 0
        n = 0
        for key in blocks:
            if key not in keys:
                break
            n += 1
        return n

    def requests(self, replica_id: str) -> int:
        """In-flight requests remembered for ``replica_id``."""
        return len(self._queues.get(replica_id, ()))
