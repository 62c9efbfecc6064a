"""The discrete-event simulation behind ``bench.routing``: N replicas serving a trace under one policy.

**A replica** prefills one request at a time, first come first served; a request's prefill time is
``CostModel.prefill_s`` with the replica's true ``Rates`` (each cached segment loaded or recomputed,
whichever is cheaper, the rest prefilled), the very model the router estimates with. Its first token
comes when its prefill ends (TTFT = that time - arrival). Decoding runs beside prefill without slowing
it (a simplification: no batching interference) and keeps the request ``running`` for
``output_tokens x decode_step_s``.

**Its cache** holds whole 512-token blocks by chain key in two tiers: L1 (device, nothing to load)
and L2 (host memory, loaded at ``load_tokens_per_s["l2"]``); together they hold the replica's
capacity. When a prefill ends, every full block of the prompt is put in L1, deepest first, so the
shared short prefix is the most recently used (blocks found in L2 move up); L1 evicts into L2, L2
evicts for good. Eviction is LRU with fair sharing per tier: the victim is the least recently used
block of the tenant most over its equal share of the tier (``TierCache``). A request's hit is its
longest contiguous prefix of cached blocks at the moment its prefill starts, at most its ``usable``
blocks; ``l1`` is the part of it held in L1 from the first block on, the rest comes from L2.

**The router** sees, for each replica, a ``ReplicaState`` (queued prefill tokens: what is left of the
prefill in progress plus, for each waiting request, its prompt less the hit it had when it was
queued; waiting and running counts; cached tokens and capacity) and the request's ``Hit`` on every
replica from the replicas' caches as they are at that instant: the exact knowledge of an index fed
without delay or loss. The ``RouteRequest`` carries the request's block keys (its usable ones), as the
live router passes a request's chain hashes, and its tenant. The policy's ``observe`` is called after each dispatch.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench._routing_trace import SimRequest
from bench.traces import HASH_BLOCK_TOKENS
from cachecore.routing.cost import CostModel, Rates, ReplicaState
from cachecore.routing.policies import Policy, RouteRequest

__all__ = ["SimResult", "SimReplica", "TierCache", "simulate"]

B = HASH_BLOCK_TOKENS


class TierCache:
    """Block keys of one tier of one replica: LRU within each tenant, fair share across tenants.

    ``put`` inserts or refreshes a key and returns what it evicted, (key, tenant) pairs, oldest first.
    The victim of an eviction is the least recently used block of the tenant holding the most blocks
    above its share (``capacity / tenants holding blocks``)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.size = 0
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._owner: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._owner

    def put(self, key: int, tenant: int) -> list[tuple[int, int]]:
        if self.capacity == 0:
            return [(key, tenant)]
        if key in self._owner:
            self._lru[tenant].move_to_end(key)
            return []
        self._lru.setdefault(tenant, OrderedDict())[key] = None
        self._owner[key] = tenant
        self.size += 1
        evicted = []
        while self.size > self.capacity:
            evicted.append(self._evict())
        return evicted

    def remove(self, key: int) -> None:
        tenant = self._owner.pop(key)
        lru = self._lru[tenant]
        del lru[key]
        if not lru:
            del self._lru[tenant]
        self.size -= 1

    def _evict(self) -> tuple[int, int]:
        share = self.capacity / len(self._lru)
        tenant = max(self._lru, key=lambda t: len(self._lru[t]) - share)
        key = next(iter(self._lru[tenant]))
        self.remove(key)
        return key, tenant


class SimReplica:
    """One simulated replica (module docstring)."""

    def __init__(self, replica_id: str, rates: Rates, l1_blocks: int, l2_blocks: int) -> None:
        self.replica_id = replica_id
        self.rates = rates
        self.l1 = TierCache(l1_blocks)
        self.l2 = TierCache(l2_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.waiting_tokens = 0
        self._queued_tokens: dict[int, int] = {}
        self.current: SimRequest | None = None
        self.current_end = 0.0
        self.running = 0
        self.busy_s = 0.0

    def hit(self, req: SimRequest) -> dict[str, int]:
        """The request's cached prefix here now, in tokens ({} when none)."""
        keys, n, l1, l2 = req.keys, 0, self.l1, self.l2
        while n < req.usable and keys[n] in l1:
            n += 1
        in_l1 = n
        while n < req.usable and (keys[n] in l1 or keys[n] in l2):
            n += 1
        return {"l1": in_l1 * B, "l2": n * B} if n else {}

    def state(self, now: float) -> ReplicaState:
        left = 0
        if self.current is not None:
            left = math.ceil(max(0.0, self.current_end - now) * self.rates.prefill_tokens_per_s)
        return ReplicaState(
            self.replica_id,
            self.rates,
            queued_prefill_tokens=self.waiting_tokens + left,
            running=self.running,
            queued_requests=len(self.waiting) + (self.current is not None),
            cached_tokens=(self.l1.size + self.l2.size) * B,
            capacity_tokens=(self.l1.capacity + self.l2.capacity) * B,
        )

    def enqueue(self, req: SimRequest, hit_tokens: int) -> None:
        tokens = req.prompt_tokens - hit_tokens
        self.waiting.append(req)
        self._queued_tokens[req.index] = tokens
        self.waiting_tokens += tokens

    def start_next(self, now: float, cost: CostModel) -> tuple[SimRequest, float, int] | None:
        """Start the next waiting request: (request, end time, loaded tokens), or None if idle."""
        if self.current is not None or not self.waiting:
            return None
        req = self.waiting.popleft()
        self.waiting_tokens -= self._queued_tokens.pop(req.index)
        seconds, loaded = cost.prefill_s(self.rates, req.prompt_tokens, self.hit(req))
        self.current, self.current_end = req, now + seconds
        self.busy_s += seconds
        return req, self.current_end, loaded

    def finish(self, req: SimRequest) -> None:
        """The prefill of ``req`` ended: cache its blocks (module docstring); it starts decoding."""
        self.current = None
        self.running += 1
        for key in reversed(req.keys):
            if key in self.l2:
                self.l2.remove(key)
            for old, tenant in self.l1.put(key, req.tenant):
                self.l2.put(old, tenant)


@dataclass(frozen=True)
class SimResult:
    policy: str
    ttft_s: list[float]  # in the order of the requests
    loaded_tokens: int
    prompt_tokens: int
    busy_s: list[float]  # per replica

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s)

    @property
    def p99_ttft(self) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def hit_ratio(self) -> float:
        """Token-weighted: prompt tokens served from cache (loaded, not recomputed) / prompt tokens."""
        return self.loaded_tokens / self.prompt_tokens

    @property
    def imbalance(self) -> float:
        """Max over mean of the replicas' busy (prefilling) seconds; 1.0 is perfectly even."""
        mean = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / mean if mean else 1.0


def simulate(
    requests: Sequence[SimRequest], policy: Policy, *, replicas: int, rates: Rates, l1_blocks: int,
    l2_blocks: int, cost: CostModel | None = None,
) -> SimResult:
    """Serve ``requests`` (in arrival order) on ``replicas`` fresh replicas routed by ``policy``."""
    cost = cost or CostModel()
    reps = [SimReplica(f"r{i}", rates, l1_blocks, l2_blocks) for i in range(replicas)]
    index_of = {r.replica_id: i for i, r in enumerate(reps)}
    ttft: dict[int, float] = {}
    loaded_total = 0
    # events: (time, order, kind, replica index, request); arrivals are merged in from the sorted list.
    events: list[tuple[float, int, int, int, SimRequest | None]] = []
    seq = 0
    DONE, DECODED = 0, 1
    nxt = 0

    def start(rep_index: int, now: float) -> None:
        nonlocal seq, loaded_total
        begun = reps[rep_index].start_next(now, cost)
        if begun is not None:
            req, end, loaded = begun
            loaded_total += loaded
            heapq.heappush(events, (end, seq, DONE, rep_index, req))
            seq += 1

    while nxt < len(requests) or events:
        if nxt < len(requests) and (not events or requests[nxt].arrival_s <= events[0][0]):
            req = requests[nxt]
            nxt += 1
            now = req.arrival_s
            states = [r.state(now) for r in reps]
            hits = {}
            for r in reps:
                h = r.hit(req)
                if h:
                    hits[r.replica_id] = h
            route = RouteRequest(req.prompt_tokens, req.session, req.keys[: req.usable], B, tenant=str(req.tenant))
            rid = policy.choose(route, states, hits)
            policy.observe(route, rid)
            reps[index_of[rid]].enqueue(req, hits.get(rid, {}).get("l2", 0))
            start(index_of[rid], now)
            continue
        now, _, kind, idx, req = heapq.heappop(events)
        rep = reps[idx]
        if kind == DONE:
            assert req is not None
            ttft[req.index] = now - req.arrival_s
            rep.finish(req)
            heapq.heappush(events, (now + req.output_tokens * rates.decode_step_s, seq, DECODED, idx, None))
            seq += 1
            start(idx, now)
        else:
            rep.running -= 1
    if len(ttft) != len(requests):
        raise RuntimeError(f"{len(requests) - len(ttft)} requests never got a first token")
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    return SimResult(policy.name, [ttft[r.index] for r in requests], loaded_total, prompt_tokens,
                     [r.busy_s for r in reps])
