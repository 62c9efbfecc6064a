"""Routing policies: which replica serves a request.

Every policy implements ``Policy``: ``choose(request, replicas, hits)`` returns the id of one alive
replica (``NoReplicaError`` when none is alive), and ``observe(request, replica_id)`` is called after
the request was dispatched there. ``hits`` maps a replica id to the request's cached prefix on that
replica (``cost.Hit``, in tokens, as the router's index reports it); a replica left out has no hit.
Policies hold only routing bookkeeping (a cursor, session -> replica, the block hashes of requests in
flight), never tokens or tenant data.
An instance is not thread-safe: the caller serialises ``choose`` and the ``observe`` that follows it
(one lock per router), and a choice never blocks.

- ``RoundRobin``: alive replicas in turn.
- ``LeastLoaded``: the fewest queued prefill tokens (then fewest running, then list order).
- ``SGLangRule``: the SGLang router's cache-aware rule. When the load (pending requests: queued +
  running) is imbalanced, i.e. ``max - min > balance_abs`` and ``max > balance_rel * min``, the least
  loaded replica; otherwise the replica with the longest hit if that hit covers more than
  ``cache_threshold`` of the prompt, else the replica with the smallest tree. SGLang's router grows a
  replica's approximate tree when it routes a request there, by the part of the prompt that tree did
  not match; here the tree of a replica is the tokens routed to it less their hit there (the router's
  own count, never shrunk: SGLang evicts its tree only past a size far above these).
- ``ExpectedTTFT``: Strata's rule, below.

**Strata's rule** (``ExpectedTTFT``). For each candidate replica ``r`` the cost model
(``cost.CostModel``) gives the request's queue wait ``wait_r`` and its prefill time once started
``busy_r`` (each cached segment loaded or recomputed, whichever is cheaper, the rest prefilled). The
request goes to the least

    cost_r = wait_r + (1 + w) * busy_r + mixing_r + eviction_r

    w = max(min_work_weight, mean waiting requests per replica)

The request's own TTFT is ``wait_r + busy_r``; the extra ``w * busy_r`` is what its prefill costs the
requests that will queue behind it: a second of prefill delays each of them by a second, and the
replicas' current queues (requests waiting, the one in prefill not counted, averaged over the alive
replicas) are the live estimate of how many that is. Minimising the request's own TTFT alone
(``w = 0``) gives up a cached prefix whenever another replica's queue is a little shorter: the prefix
is then recomputed (work the cluster did not need, which delays later requests) and cached twice
(space the caches did not need to spend). With the weight, a replica holding the prefix is left only
when its extra wait exceeds ``(1 + w)`` times the prefill time its hit saves, so a long prefix buys
proportionally more queue than a short one. ``min_work_weight`` (1.0) keeps that value when nothing
waits yet; ``work_weight`` fixes ``w`` instead. The peers weigh the same trade-off with blunter
instruments: SGLang's router follows the longest match above a share of the prompt whatever the
queues, until the pending counts differ by an absolute and a relative threshold; Dynamo's KV router
minimises ``overlap_score_weight * prefill blocks + decode blocks``, a fixed weight on load counted
in blocks; vLLM production-stack's prefix router sends a request to its longest match, ignoring load.
Here both sides are seconds from measured rates, and the weight follows the load.

- **Hits include the router's own in-flight requests** (``inflight.InFlight``): a prefix dispatched to
  a replica and still in its queue counts as held there in L1 (what SGLang's and production-stack's
  approximate trees do on insert), when the request carries its block keys (``RouteRequest.blocks``).
- **A hit counts as far as it survives the queue**: when the replica reports its capacity
  (``ReplicaState.capacity_tokens``), the hit is clipped to that capacity less the tokens its queue
  will prefill and cache first (``queued_prefill_tokens``), since those writes evict before the
  request starts. This matters where caches hold only a few prompts.
- **Prefill guard** (``prefill_guard``, 1.0): a replica whose queue wait exceeds the least waiting
  alive replica's by more than ``prefill_guard`` times the request's own prefill without any cache is
  not a candidate. A hit may buy at most that much queue: a short request is not parked behind a long
  one for its prefix, which is where the weighted cost alone lengthened the p99. A prompt whose own
  prefill exceeds ``long_prefill_s`` (1.2 s) may in addition wait what its hit there saves: its p99
  is its own prefill, not a short one's parking, and moving it gives up a long prefix and caches it
  twice (``bench.routing --shape fast25`` at 10% cache, hit of one LRU cache: 89.6% -> 91.5% at 4
  replicas, 89.8% -> 91.8% at 16, 85.6% -> 91.6% at 64; the default shape has no prompt that long).
- **Large writes** (``eviction_r``): a request whose uncached tokens on a replica reach
  ``LARGE_WRITE_SHARE`` (a quarter) of its capacity flushes much of that cache at once. One LRU cache
  of the replicas' total capacity would evict only its oldest tokens; a replica evicts its own
  oldest, which may be young. The router stamps the prompts it sends each replica with its own clock
  (prompt tokens sent to every replica so far: ``WriteAges``), and ``eviction_r`` is
  ``eviction_weight`` (1.0) times the prefill time of the tokens the write would push out, each
  counted ``1 - age / horizon`` (0 past it; ``horizon``: the alive replicas' total capacity, the age
  at which one LRU cache of that size evicts): a giant prompt goes where it pushes out the oldest
  cache. It applies only where a replica's capacity holds at least ``SCARCE_PROMPTS`` prompts of the
  mean size routed so far: where every prompt flushes a cache, the stamps (which do not see that a
  hit keeps its prefix) only pull requests off their prefixes. (``bench.routing --shape fast25`` at
  10% cache and 64 replicas, with the long-prompt guard: hit of one LRU cache 91.6% -> 93.1%; no other
  cell moves. Without the mean-size condition the default shape's 64-replica 10% cell fell 92.6% ->
  88.9%.)
- **Tenant mixing** (``mixing_r``, when the request names its tenant, ``RouteRequest.tenant``): each
  tier's eviction shares space fairly among the tenants holding blocks in it, so on a replica whose
  caches hold only a few prompts a second tenant's arrival halves what each can keep. The router
  remembers, per replica, the tenants of its most recent writes (the uncached tokens it sent there,
  newest first, up to the replica's capacity: ``RecentWrites``); ``mixing_r`` is ``tenant_weight``
  (1.0) times the share of them from other tenants times the request's uncached prefill time there.
  It applies only where the replica's capacity is under ``SCARCE_PROMPTS`` (4) prompts of the
  request's size; with larger caches the shares keep whole prefixes and the term would only unbalance
  load. (On ``bench.routing`` at 10% cache and 64 replicas, the default shape: hit 45.5% -> 50.5%,
  of one LRU cache 83% -> 93%.)
- **Ties** (equal cost: typically several idle replicas and no hit) go to the replica the router has
  sent the fewest uncached prompt tokens (SGLang's "smallest tree"), then list order: spreading what
  replicas must cache evens out how long each keeps its blocks. (Tie-breaking by tokens cached, which
  is equal once caches are full, sent every tie to the first replica.)
- **Stickiness**: a session returns to its last replica unless that replica's cost exceeds the best
  by more than ``sticky_bonus_s``.
- **Load guard** (off by default): a replica whose queue wait exceeds the least-loaded alive
  replica's by more than ``load_guard`` seconds is not a candidate (the least loaded never is
  excluded): a hard cap in seconds on top of the prefill guard.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cachecore.routing.cost import TIERS, CostModel, Hit, ReplicaState
from cachecore.routing.inflight import InFlight

__all__ = [
    "ROUTING_POLICIES",
    "ExpectedTTFT",
    "LeastLoaded",
    "NoReplicaError",
    "Policy",
    "RecentWrites",
    "RoundRobin",
    "RouteRequest",
    "SGLangRule",
    "WriteAges",
    "deepest",
]


class NoReplicaError(RuntimeError):
    """No alive replica to route to (the gateway answers a retryable 503)."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request: its prompt length, a stickiness key (the request's
    ``user``, or a digest of the chat's first turn; None: no stickiness), optionally the keys of its
    full blocks as the router's index keys them (chain hashes) with the tokens per block
    (``ExpectedTTFT`` then counts prefixes it dispatched and no replica cached yet), and optionally
    its tenant (``ExpectedTTFT`` then weighs tenants sharing a small cache)."""

    prompt_tokens: int
    session: str | None = None
    blocks: tuple[Hashable, ...] = ()
    block_tokens: int = 0
    tenant: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {self.prompt_tokens!r}")
        if not isinstance(self.blocks, tuple):
            raise ValueError(f"blocks must be a tuple of block keys, got {type(self.blocks).__name__}")
        bt = self.block_tokens
        if isinstance(bt, bool) or not isinstance(bt, int) or bt < 0 or (self.blocks and bt == 0):
            raise ValueError(f"block_tokens must be an int >= 0, and > 0 when blocks are given; got {bt!r}")


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]) -> str:
        """The id of the alive replica that should serve ``request``; raises ``NoReplicaError``."""
        ...

    def observe(self, request: RouteRequest, replica_id: str) -> None:
        """``request`` was dispatched to ``replica_id`` (may be a no-op)."""
        ...


def deepest(hit: Hit | None, prompt_tokens: int) -> int:
    """The furthest a hit reaches over every tier, clipped to the prompt."""
    if not hit:
        return 0
    return min(max(hit.get(t, 0) for t in TIERS), prompt_tokens)


def _alive(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    alive = [r for r in replicas if r.alive]
    if not alive:
        raise NoReplicaError("no alive replica")
    return alive


def _least_loaded(alive: Sequence[ReplicaState]) -> ReplicaState:
    return min(alive, key=lambda r: (r.queued_prefill_tokens, r.running))


class RoundRobin:
    """Alive replicas in turn, in the order given (a dead replica is skipped, not waited for)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]) -> str:
        alive = _alive(replicas)
        chosen = alive[self._turn % len(alive)]
        self._turn += 1
        return chosen.replica_id

    def observe(self, request: RouteRequest, replica_id: str) -> None:
        return None


class LeastLoaded:
    """The alive replica with the fewest queued prefill tokens (ties: fewest running, then order)."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]) -> str:
        return _least_loaded(_alive(replicas)).replica_id

    def observe(self, request: RouteRequest, replica_id: str) -> None:
        return None


class SGLangRule:
    """The SGLang router's cache-aware rule (module docstring). Defaults are the router's own:
    ``balance_abs=32`` pending requests, ``balance_rel=1.0001``, ``cache_threshold=0.5``."""

    name = "sglang"

    def __init__(self, *, balance_abs: int = 32, balance_rel: float = 1.0001, cache_threshold: float = 0.5) -> None:
        if balance_abs < 0 or balance_rel < 1.0 or not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(
                f"need balance_abs >= 0, balance_rel >= 1, 0 <= cache_threshold <= 1; got "
                f"{balance_abs!r}, {balance_rel!r}, {cache_threshold!r}"
            )
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold
        self._tree: dict[str, int] = {}  # replica id -> tokens its approximate tree grew by
        self._matched: dict[str, int] = {}  # the last choice's hit per replica, for observe

    @staticmethod
    def load(replica: ReplicaState) -> int:
        """Pending requests on the replica, as the SGLang router counts them."""
        return replica.queued_requests + replica.running

    def imbalanced(self, alive: Sequence[ReplicaState]) -> bool:
        loads = [self.load(r) for r in alive]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def tree_tokens(self, replica_id: str) -> int:
        """The size of the replica's approximate tree, in tokens."""
        return self._tree.get(replica_id, 0)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]) -> str:
        alive = _alive(replicas)
        self._matched = {r.replica_id: deepest(hits.get(r.replica_id), request.prompt_tokens) for r in alive}
        if self.imbalanced(alive):
            return min(alive, key=self.load).replica_id
        best = max(alive, key=lambda r: self._matched[r.replica_id])
        matched = self._matched[best.replica_id]
        if request.prompt_tokens and matched / request.prompt_tokens > self.cache_threshold:
            return best.replica_id
        return min(alive, key=lambda r: self.tree_tokens(r.replica_id)).replica_id

    def observe(self, request: RouteRequest, replica_id: str) -> None:
        grown = request.prompt_tokens - self._matched.get(replica_id, 0)
        self._tree[replica_id] = self.tree_tokens(replica_id) + grown


#: The tenant term applies where a replica's caches hold fewer than this many prompts of the
#: request's size: there a tier's fair share per tenant is too small to keep a prompt's prefix. The
#: eviction term applies only where they hold at least this many prompts of the mean size.
SCARCE_PROMPTS = 4
#: The eviction term applies to a request whose uncached tokens reach this share of a replica's
#: capacity: a write that large evicts a good part of that replica's cache at once.
LARGE_WRITE_SHARE = 0.25


class RecentWrites:
    """The tenants of the tokens the router most recently sent one replica to cache: the newest
    writes that together reach its capacity (what an LRU cache of that size holds, refreshes aside)."""

    def __init__(self) -> None:
        self._writes: deque[tuple[str, int]] = deque()
        self._by_tenant: Counter[str] = Counter()
        self._total = 0

    def add(self, tenant: str, tokens: int, capacity: int) -> None:
        if tokens <= 0:  # a whole hit wrote nothing; kept, such entries would never leave
            return
        self._writes.append((tenant, tokens))
        self._by_tenant[tenant] += tokens
        self._total += tokens
        while len(self._writes) > 1 and self._total - self._writes[0][1] >= capacity:
            old, n = self._writes.popleft()
            self._by_tenant[old] -= n
            self._total -= n
            if self._by_tenant[old] <= 0:
                del self._by_tenant[old]

    def __len__(self) -> int:
        return len(self._writes)

    def others_share(self, tenant: str) -> float:
        """The share of the remembered tokens that other tenants wrote (0 when nothing was written)."""
        return 1.0 - self._by_tenant.get(tenant, 0) / self._total if self._total else 0.0


class WriteAges:
    """When the router sent one replica the prompts it most recently cached there (a hit refreshes its
    prefix, so a whole prompt counts), on the router's own clock (prompt tokens sent to every replica
    so far): the newest writes that together reach the replica's capacity, oldest first, roughly what
    an LRU cache of that size holds (a refreshed prefix also stays in its older write)."""

    def __init__(self) -> None:
        self._writes: deque[tuple[int, int]] = deque()  # (clock at the write, tokens)
        self._total = 0

    def add(self, stamp: int, tokens: int, capacity: int) -> None:
        if tokens <= 0:
            return
        self._writes.append((stamp, tokens))
        self._total += tokens
        while len(self._writes) > 1 and self._total - self._writes[0][1] >= capacity:
            self._total -= self._writes.popleft()[1]

    def evicted_value(self, tokens: int, capacity: int, now: int, horizon: int) -> float:
        """The tokens that writing ``tokens`` more evicts (the oldest beyond ``capacity``), each counted
        ``1 - age / horizon`` (0 when older than ``horizon``), ``age`` being ``now`` less its write's
        clock; 0 when nothing is evicted."""
        over = self._total + tokens - capacity
        value = 0.0
        for stamp, n in self._writes:
            if over <= 0:
                break
            take = min(n, over)
            over -= take
            value += take * max(0.0, 1.0 - (now - stamp) / horizon)
        return value


class ExpectedTTFT:
    """Strata's rule: the least ``wait + (1 + w) * busy + mixing + eviction``, with in-flight prefixes,
    hits clipped to what survives the queue, a prefill guard, ties to the replica sent the fewest uncached
    tokens, stickiness and an optional load guard (module docstring).

    ``w`` is how many requests' worth of delay a second of prefill is charged beyond the request's
    own: ``work_weight`` when given (0: the request's expected TTFT alone), else the mean waiting
    requests per alive replica, at least ``min_work_weight``. ``sticky_bonus_s``: how much higher
    (seconds of cost) a session's last replica may be than the best before the session moves.
    ``load_guard``: seconds of queue wait above the least-loaded alive replica's past which a replica
    is not a candidate (None: no guard). ``prefill_guard``: the same in multiples of the request's
    own prefill time without cache (None: no guard). ``long_prefill_s``: past this own prefill time
    the guard also allows what the request's hit saves (None: never). ``tenant_weight``: the weight
    of the tenant mixing term (0: off). ``eviction_weight``: the weight of the large-write eviction
    term (0: off). ``max_sessions``: sessions remembered (least recently routed
    forgotten first)."""

    name = "strata"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        work_weight: float | None = None,
        min_work_weight: float = 1.0,
        sticky_bonus_s: float = 0.05,
        load_guard: float | None = None,
        prefill_guard: float | None = 1.0,
        tenant_weight: float = 1.0,
        eviction_weight: float = 1.0,
        long_prefill_s: float | None = 1.2,
        max_sessions: int = 100_000,
    ) -> None:
        if (work_weight is not None and work_weight < 0) or min_work_weight < 0 or sticky_bonus_s < 0 \
                or (load_guard is not None and load_guard < 0) or (prefill_guard is not None and prefill_guard < 0) \
                or tenant_weight < 0 or eviction_weight < 0 or (long_prefill_s is not None and long_prefill_s < 0) \
                or max_sessions < 1:
            raise ValueError(
                f"need work_weight None or >= 0, min_work_weight >= 0, sticky_bonus_s >= 0, load_guard and "
                f"prefill_guard None or >= 0, tenant_weight and eviction_weight >= 0, long_prefill_s None or >= 0, "
                f"max_sessions >= 1; got {work_weight!r}, {min_work_weight!r}, {sticky_bonus_s!r}, {load_guard!r}, "
                f"{prefill_guard!r}, {tenant_weight!r}, {eviction_weight!r}, {long_prefill_s!r}, {max_sessions!r}"
            )
        self.cost = cost or CostModel()
        self.work_weight = work_weight
        self.min_work_weight = min_work_weight
        self.sticky_bonus_s = sticky_bonus_s
        self.load_guard = load_guard
        self.prefill_guard = prefill_guard
        self.tenant_weight = tenant_weight
        self.eviction_weight = eviction_weight
        self.long_prefill_s = long_prefill_s
        self._ages: dict[str, WriteAges] = {}  # replica id -> when the router sent it what it cached
        self._clock = 0  # prompt tokens sent to every replica so far
        self._routed = 0  # requests observed
        self.max_sessions = max_sessions
        self.inflight = InFlight()
        self._writes: dict[str, RecentWrites] = {}  # replica id -> tenants of what the router sent it to cache
        self._capacity: dict[str, int] = {}  # replica id -> its reported capacity_tokens (0: not reported)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._uncached: dict[str, int] = {}  # replica id -> prompt tokens sent there less their hits
        self._matched: dict[str, int] = {}  # the last choice's hit per replica, for observe

    def hit(self, request: RouteRequest, replica: ReplicaState, hits: Mapping[str, Hit]) -> Hit:
        """The request's hit on ``replica``: the index's, extended in L1 by the longest prefix of its
        blocks that the router's in-flight requests to that replica hold, and clipped to what the
        queue ahead leaves of the replica's capacity when it reports one (module docstring)."""
        hit = hits.get(replica.replica_id) or {}
        pending = self.inflight.match(replica.replica_id, request.blocks) * request.block_tokens
        if pending > deepest(hit, request.prompt_tokens):
            out, reached = {}, 0
            for tier in TIERS:  # cumulative: every tier reaches at least the in-flight prefix
                reached = max(hit.get(tier, reached), pending)
                out[tier] = reached
            hit = out
        room = replica.capacity_tokens - replica.queued_prefill_tokens
        if replica.capacity_tokens and hit and deepest(hit, request.prompt_tokens) > room:
            hit = {tier: min(end, max(0, room)) for tier, end in hit.items()}  # what survives the queue's writes
        return hit

    def estimates(
        self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]
    ) -> dict[str, tuple[float, float]]:
        """(queue wait, prefill once started), in seconds, of every candidate: alive and within the
        load and prefill guards. Forgets in-flight requests the replicas' queues no longer hold."""
        alive = _alive(replicas)
        waits = {r.replica_id: self.cost.queue_wait_s(r) for r in alive}
        least = min(waits.values())
        limit = least + self.load_guard if self.load_guard is not None else math.inf
        out = {}
        self._matched = {}
        for r in replicas:
            if not r.alive:
                self.inflight.forget(r.replica_id)
                continue
            self.inflight.trim(r.replica_id, r.queued_requests)
            self._capacity[r.replica_id] = r.capacity_tokens
            wait = waits[r.replica_id]
            own = request.prompt_tokens / r.rates.prefill_tokens_per_s
            hit = self.hit(request, r, hits)
            busy = self.cost.prefill_s(r.rates, request.prompt_tokens, hit)[0]
            if wait > least and (wait > limit or (self.prefill_guard is not None and
                                                  wait > least + self.guard_allowance_s(own, busy))):
                continue
            self._matched[r.replica_id] = deepest(hit, request.prompt_tokens)
            out[r.replica_id] = (waits[r.replica_id], busy)
        return out

    def guard_allowance_s(self, own: float, busy: float) -> float:
        """The queue wait above the least a replica may have and stay a candidate: ``prefill_guard``
        times the request's prefill without cache (``own``), plus, for a prompt whose ``own`` exceeds
        ``long_prefill_s``, what its hit there saves (``own - busy``)."""
        long = self.long_prefill_s is not None and own > self.long_prefill_s
        return (self.prefill_guard or 0.0) * own + (own - busy if long else 0.0)

    def weight(self, replicas: Sequence[ReplicaState]) -> float:
        """``w``: ``work_weight`` if fixed, else the mean requests waiting (the one in prefill not
        counted) per alive replica, at least ``min_work_weight``."""
        if self.work_weight is not None:
            return self.work_weight
        alive = _alive(replicas)
        waiting = sum(max(0, r.queued_requests - 1) for r in alive) / len(alive)
        return max(self.min_work_weight, waiting)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]) -> str:
        est = self.estimates(request, replicas, hits)
        w = self.weight(replicas)
        rates = {r.replica_id: r.rates.prefill_tokens_per_s for r in replicas}
        horizon = sum(r.capacity_tokens for r in replicas if r.alive)
        cost = {rid: wait + (1.0 + w) * busy + self.mixing_s(request, rid, rates[rid])
                + self.eviction_s(request, rid, rates[rid], horizon)
                for rid, (wait, busy) in est.items()}
        best = min(cost, key=lambda rid: (cost[rid], self.uncached_tokens(rid)))
        if request.session is not None:
            last = self._sessions.get(request.session)
            if last is not None and last in cost and cost[last] <= cost[best] + self.sticky_bonus_s:
                return last
        return best

    def mixing_s(self, request: RouteRequest, replica_id: str, prefill_tokens_per_s: float) -> float:
        """What caching the request on ``replica_id`` costs the tenants' shares there, in seconds: its
        uncached tokens' prefill time x the share of the replica's recent writes from other tenants x
        ``tenant_weight``; 0 unless the request has a tenant and the replica's capacity is reported and
        under ``SCARCE_PROMPTS`` prompts of this size (module docstring)."""
        capacity = self._capacity.get(replica_id, 0)
        writes = self._writes.get(replica_id)
        if request.tenant is None or writes is None or not 0 < capacity < SCARCE_PROMPTS * request.prompt_tokens:
            return 0.0
        new = request.prompt_tokens - self._matched.get(replica_id, 0)
        return self.tenant_weight * writes.others_share(request.tenant) * new / prefill_tokens_per_s

    def eviction_s(self, request: RouteRequest, replica_id: str, prefill_tokens_per_s: float, horizon: int) -> float:
        """What the request's writes on ``replica_id`` evict, in seconds: the prefill time of the tokens
        they push out, each counted by how young it is against ``horizon`` (the alive replicas' total
        capacity; ``WriteAges.evicted_value``), x ``eviction_weight``; 0 unless the replica reports its
        capacity, the request's uncached tokens there reach ``LARGE_WRITE_SHARE`` of it and it holds
        ``SCARCE_PROMPTS`` prompts of the mean size routed so far (module docstring)."""
        capacity = self._capacity.get(replica_id, 0)
        ages = self._ages.get(replica_id)
        if not self.eviction_weight or ages is None or not capacity or not horizon:
            return 0.0
        new = request.prompt_tokens - self._matched.get(replica_id, 0)
        if new < LARGE_WRITE_SHARE * capacity or capacity < SCARCE_PROMPTS * self._clock / self._routed:
            return 0.0
        return self.eviction_weight * ages.evicted_value(new, capacity, self._clock, horizon) / prefill_tokens_per_s

    def observe(self, request: RouteRequest, replica_id: str) -> None:
        new = request.prompt_tokens - self._matched.get(replica_id, 0)
        self._uncached[replica_id] = self.uncached_tokens(replica_id) + new
        self._clock += request.prompt_tokens
        self._routed += 1
        self._ages.setdefault(replica_id, WriteAges()).add(self._clock, request.prompt_tokens,
                                                           self._capacity.get(replica_id, 0))
        if request.tenant is not None:
            self._writes.setdefault(replica_id, RecentWrites()).add(
                request.tenant, new, self._capacity.get(replica_id, 0))
        if request.blocks:
            self.inflight.add(replica_id, request.blocks)
        if request.session is None:
            return
        self._sessions[request.session] = replica_id
        self._sessions.move_to_end(request.session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def uncached_tokens(self, replica_id: str) -> int:
        """Prompt tokens the router sent ``replica_id`` less the hit each had there (what it had to cache)."""
        return self._uncached.get(replica_id, 0)

    def session_replica(self, session: str) -> str | None:
        """The replica a session was last dispatched to (None: unknown or forgotten)."""
        return self._sessions.get(session)


#: Policy constructors by name (``ROUTING_POLICIES[name](**params)``).
ROUTING_POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    SGLangRule.name: SGLangRule,
    ExpectedTTFT.name: ExpectedTTFT,
}
