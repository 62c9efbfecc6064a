"""Routing policies: which replica serves a request.

Every policy implements ``Policy``: ``choose(request, replicas, hits)`` returns the id of one alive
replica (``NoReplicaError`` when none is alive), and ``observe(request, replica_id)`` is called after
the request was dispatched there. ``hits`` maps a replica id to the request's cached prefix on that
replica (``cost.Hit``, in tokens, as the router's index reports it); a replica left out has no hit.
Policies hold only routing bookkeeping (a cursor, session -> replica), never tokens or tenant data.
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
- ``ExpectedTTFT``: Strata's rule: the minimum of ``CostModel.expected_ttft_s`` over the candidates,
  with session stickiness (a session returns to its last replica unless that replica's estimate is
  worse than the best by more than ``sticky_bonus_s``) and a load guard (a replica whose queue wait
  exceeds the least-loaded alive replica's by more than ``load_guard`` is not a candidate, unless
  every replica is excluded that way, which cannot happen: the least loaded one never is).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cachecore.routing.cost import TIERS, CostModel, Hit, ReplicaState

__all__ = [
    "ROUTING_POLICIES",
    "ExpectedTTFT",
    "LeastLoaded",
    "NoReplicaError",
    "Policy",
    "RoundRobin",
    "RouteRequest",
    "SGLangRule",
    "deepest",
]


class NoReplicaError(RuntimeError):
    """No alive replica to route to (the gateway answers a retryable 503)."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request: its prompt length and a stickiness key (the request's
    ``user``, or a digest of the chat's first turn; None: no stickiness)."""

    prompt_tokens: int
    session: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {self.prompt_tokens!r}")


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


class ExpectedTTFT:
    """Strata's rule: the least expected TTFT, with stickiness and a load guard (module docstring).

    ``sticky_bonus_s``: how much worse (seconds) a session's last replica may be than the best before
    the session moves. ``load_guard``: how much longer (seconds) a replica's queue wait may be than
    the least-loaded alive replica's before it stops being a candidate. ``max_sessions``: sessions
    remembered (least recently routed forgotten first). Ties go to the replica caching the least."""

    name = "strata"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        sticky_bonus_s: float = 0.05,
        load_guard: float = 2.0,
        max_sessions: int = 100_000,
    ) -> None:
        if sticky_bonus_s < 0 or load_guard < 0 or max_sessions < 1:
            raise ValueError(
                f"need sticky_bonus_s >= 0, load_guard >= 0, max_sessions >= 1; got "
                f"{sticky_bonus_s!r}, {load_guard!r}, {max_sessions!r}"
            )
        self.cost = cost or CostModel()
        self.sticky_bonus_s = sticky_bonus_s
        self.load_guard = load_guard
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def estimates(
        self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]
    ) -> dict[str, float]:
        """Expected TTFT (seconds) of every candidate: alive and not excluded by the load guard."""
        alive = _alive(replicas)
        waits = {r.replica_id: self.cost.queue_wait_s(r) for r in alive}
        limit = min(waits.values()) + self.load_guard
        out = {}
        for r in alive:
            if waits[r.replica_id] > limit:
                continue
            busy = self.cost.prefill_s(r.rates, request.prompt_tokens, hits.get(r.replica_id) or {})[0]
            out[r.replica_id] = waits[r.replica_id] + busy  # = cost.expected_ttft_s, the wait computed once
        return out

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState], hits: Mapping[str, Hit]) -> str:
        est = self.estimates(request, replicas, hits)
        cached = {r.replica_id: r.cached_tokens for r in replicas}
        best = min(est, key=lambda rid: (est[rid], cached[rid]))
        if request.session is not None:
            last = self._sessions.get(request.session)
            if last is not None and last in est and est[last] <= est[best] + self.sticky_bonus_s:
                return last
        return best

    def observe(self, request: RouteRequest, replica_id: str) -> None:
        if request.session is None:
            return
        self._sessions[request.session] = replica_id
        self._sessions.move_to_end(request.session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

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
