"""The gateway's router: which replica of a deployment serves a request.

One ``Router`` per deployment (``router_for``). With one routable replica it returns it at once (no
hashing, no lookups). With several (unless ``STRATA_ROUTING=round_robin``):

- a background thread polls every routable replica; one found dead leaves routing at once (and is
  revived in the background) even with no traffic;
- a ``PrefixIndex`` of which replica probably holds which block hashes, fed by that thread
  that polls each replica's ``kv_events(since_seq)`` (applied in order; on a gap, or a replica seen
  for the first time, it reconciles from ``kv_snapshot()``) and its ``info()`` (``replica_id``,
  ``namespace_fields``, and ``router``: measured ``rates``, ``queued_prefill_tokens``, ``running``);
- per request: the request's block hashes (``request_hashes`` over the replica's namespace fields, the
  scope salt and the client's cache salt from the worker request dict: the router sees nothing the
  gateway does not already hold, and a tenant's hashes only ever match its own scope), the index's
  hits, one ``ReplicaState`` per routable replica (its polled queue and running count, raised to this
  process's own not-yet-polled dispatches), and the ``ExpectedTTFT`` policy's choice, with stickiness
  by session (the request's ``session`` or ``user``; otherwise a digest of the scope and the prompt's
  first block, i.e. the chat's first turn);
- after the replica served it: ``index.correct`` with the served ``cached_tokens`` (what the replica
  re-checked), so a stale hit is not trusted again.

With ``STRATA_ROUTING=round_robin`` the choice is round robin over the routable replicas. Routing never
fails a request: any error inside the router falls back to round robin and is logged.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time

import strata_env
from cachecore import events
from cachecore.routing import cost, hashes, policies
from cachecore.routing import index as prefix_index
from controlplane.runtime.replicas import Replica, ReplicaSet, gone

logger = logging.getLogger("controlplane.runtime")

POLL_INTERVAL_S = 0.2
POLL_TIMEOUT_S = 2.0
SESSION_PREFIX_TOKENS = 64  # the prompt's first tokens that name a session without a ``user``


def session_key(req: dict) -> str:
    """The stickiness key of a worker request: its ``session``/``user`` when given, else a digest of
    the scope salt and the prompt's first tokens (the first turn of a chat repeats in every turn)."""
    explicit = req.get("session") or req.get("user")
    if explicit:
        return "u:" + hashlib.blake2b(f"{req.get('tenant')}\x00{explicit}".encode(), digest_size=12).hexdigest()
    h = hashlib.blake2b(digest_size=12)
    h.update(bytes(req.get("scope_salt") or b""))
    h.update(b"\x00" + str(req.get("cache_salt") or "").encode() + b"\x00")
    for t in (req.get("prompt") or [])[:SESSION_PREFIX_TOKENS]:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return "p:" + h.hexdigest()


class _ReplicaView:
    """What the poller last learned from one replica."""

    def __init__(self) -> None:
        self.replica_id: str | None = None
        self.namespace_fields: dict | None = None
        self.router: dict = {}
        self.synced = False  # the index holds a snapshot of it (events apply after it)


class Router:
    """Chooses a replica of one deployment per request (see the module docstring)."""

    def __init__(self, replicas: ReplicaSet, *, join=None) -> None:
        self.replicas = replicas
        self._rr = itertools.count()
        self._join = join
        routed = strata_env.routing() != "round_robin"
        self._views: dict[int, _ReplicaView] = {}
        self.index = None
        self.policy = None
        self.decisions = {"single": 0, "round_robin": 0, "policy": 0, "fallback": 0}
        if routed:
            self.policy = policies.ExpectedTTFT(cost.CostModel())
            self.index = prefix_index.PrefixIndex()

    @property
    def mode(self) -> str:
        return getattr(self.policy, "name", "round_robin") if self.policy is not None else "round_robin"

    def use(self, name: str, **params) -> None:
        """Route with ``cachecore.routing.policies.ROUTING_POLICIES[name](**params)`` from now on (the
        benchmark compares policies on one deployment). Raises KeyError for an unknown name and
        RuntimeError when routing is switched off (``STRATA_ROUTING=round_robin``)."""
        if self.index is None:
            raise RuntimeError("routing policies are switched off (STRATA_ROUTING=round_robin)")
        if name == policies.ExpectedTTFT.name:
            params.setdefault("cost", cost.CostModel())
        self.policy = policies.ROUTING_POLICIES[name](**params)

    # ------------------------------------------------------------------ choosing
    def choose(self, req: dict | None, *, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The replica for ``req`` among the routable ones (minus ``exclude``), or None if none is."""
        candidates = [r for r in self.replicas.routable() if r.index not in exclude]
        if not candidates:
            return None
        if len(candidates) == 1:
            self.decisions["single"] += 1
            return candidates[0]
        if self.policy is None or not isinstance(req, dict) or not req.get("prompt"):
            self.decisions["round_robin"] += 1
            return candidates[next(self._rr) % len(candidates)]
        try:
            chosen = self._choose_by_policy(req, candidates)
            self.decisions["policy"] += 1
            return chosen
        except Exception:
            logger.exception("router for %s failed; round robin for this request", self.replicas.deployment)
            self.decisions["fallback"] += 1
            return candidates[next(self._rr) % len(candidates)]

    def _hashes(self, req: dict, view: _ReplicaView) -> list[bytes]:
        fields = view.namespace_fields
        if req.get("lora"):  # an adapter's request: its KV is keyed under the adapter's scope (lora_id)
            fields = {**fields, "lora_id": req["lora"]["scope"]}
        return hashes.request_hashes(fields, bytes(req["scope_salt"]), list(req["prompt"]),
                                     hashes.request_salt(req.get("cache_salt")))

    def _state(self, rep: Replica, view: _ReplicaView | None):
        """The policy's view of ``rep``: its measured rates and queue (polled), the queue and running
        count raised to this process's own dispatches not yet seen by a poll."""
        router = (view.router if view is not None else None) or {}
        rates = router.get("rates") or {}
        known = {k: rates[k] for k in ("prefill_tokens_per_s", "load_tokens_per_s", "decode_step_s") if rates.get(k)}
        try:
            measured = cost.Rates(**known)
        except (TypeError, ValueError):
            measured = cost.Rates()
        return cost.ReplicaState(
            replica_id=(view.replica_id if view is not None else None) or rep.name, rates=measured,
            queued_prefill_tokens=max(int(router.get("queued_prefill_tokens") or 0), rep.pending_tokens),
            running=max(int(router.get("running") or 0), rep.inflight), alive=True,
            queued_requests=int(router.get("queued_requests") or 0),
            cached_tokens=int(router.get("cached_tokens") or 0),
            capacity_tokens=int(router.get("capacity_tokens") or 0))

    def _choose_by_policy(self, req: dict, candidates: list[Replica]) -> Replica:
        views = {r.index: self._views.get(r.index) for r in candidates}
        hits: dict = {}
        blocks: tuple[bytes, ...] = ()
        block_tokens = 0
        indexed = [views[r.index] for r in candidates if views[r.index] is not None and views[r.index].namespace_fields]
        if self.index is not None and indexed:
            first = indexed[0]  # replicas of a deployment share their namespace fields
            hashes = self._hashes(req, first)
            req["_route_hashes"] = hashes
            block_tokens = int(first.namespace_fields.get("block_size") or 16)
            hits = self.index.match(hashes, block_tokens)
            # The chain hashes (tenant-scoped: the scope salt is in them) let the policy count a prefix
            # it dispatched that no replica has reported cached yet (cachecore.routing.inflight).
            blocks = tuple(hashes)
        states = [self._state(r, views[r.index]) for r in candidates]
        by_id = {s.replica_id: r for s, r in zip(states, candidates, strict=True)}
        tenant = req.get("tenant")
        request = policies.RouteRequest(prompt_tokens=len(req["prompt"]), session=session_key(req),
                                        blocks=blocks, block_tokens=block_tokens if blocks else 0,
                                        tenant=str(tenant) if tenant is not None else None)
        replica_id = self.policy.choose(request, states, hits)
        self.policy.observe(request, replica_id)
        return by_id[replica_id]

    def served(self, rep: Replica, req: dict | None, cached_tokens: int | None) -> None:
        """The replica re-checked the request's hit: correct the index with what it really served."""
        if self.index is None or not isinstance(req, dict) or cached_tokens is None:
            return
        hashes = req.pop("_route_hashes", None)
        view = self._views.get(rep.index)
        if hashes and view is not None and view.replica_id:
            try:
                self.index.correct(view.replica_id, hashes, int(cached_tokens))
            except Exception:
                logger.exception("index correction failed for %s", rep.name)

    def dropped(self, rep: Replica) -> None:
        """``rep`` died: its entries leave the index, and it resyncs from a snapshot when back."""
        view = self._views.pop(rep.index, None)
        if self.index is not None and view is not None and view.replica_id:
            self.index.drop_replica(view.replica_id)

    # ------------------------------------------------------------------ polling (background thread)
    def poll_once(self) -> None:
        """One round over the routable replicas: events into the index, router stats into views."""
        if self.policy is None or self._join is None or self.replicas.count < 2:
            return
        try:
            ray = self._join()
        except Exception:  # Ray is not reachable (shut down, not configured): nothing to poll
            return
        routable = self.replicas.routable()
        for index in set(self._views) - {r.index for r in routable}:  # scaled away or dead: forget it
            self.dropped(self.replicas.replica(index))
        for rep in routable:
            handle = rep.handle
            if handle is None:
                continue
            view = self._views.setdefault(rep.index, _ReplicaView())
            try:
                info = ray.get(handle.info.remote(), timeout=POLL_TIMEOUT_S)
                replica_id = str(info.get("replica_id") or rep.name)
                if view.replica_id not in (None, replica_id):  # restarted: a new id, an empty cache
                    if self.index is not None:
                        self.index.drop_replica(view.replica_id)
                    view.synced = False
                view.replica_id = replica_id
                view.namespace_fields = info.get("namespace_fields")
                view.router = info.get("router") or {}
                if self.index is None or not hasattr(handle, "kv_events"):
                    continue
                if not view.synced:
                    self.index.reconcile(ray.get(handle.kv_snapshot.remote(), timeout=POLL_TIMEOUT_S))
                    view.synced = True
                    continue
                answer = ray.get(handle.kv_events.remote(self.index.expected_seq(view.replica_id)),
                                 timeout=POLL_TIMEOUT_S)
                ok = not answer.get("gap")
                for batch in answer.get("batches", ()):
                    if ok:
                        ok = self.index.apply(events.EventBatch.from_dict(batch))
                if not ok:
                    self.index.reconcile(ray.get(handle.kv_snapshot.remote(), timeout=POLL_TIMEOUT_S))
            except Exception as exc:
                view.synced = False
                if gone(exc):  # gone: out of routing at once, revived in the background
                    self.replicas.mark_dead(rep, revive=True)
                    self.dropped(rep)
                else:  # slow: the serving path decides
                    logger.debug("poll of %s failed: %r", rep.name, exc)


_routers: dict[str, Router] = {}
_routers_lock = threading.Lock()
_poller: threading.Thread | None = None


def router_for(replicas: ReplicaSet, *, join=None) -> Router:
    """The router of ``replicas``' deployment (one per process), starting the poller when useful."""
    router = _routers.get(replicas.deployment)
    if router is None or router.replicas is not replicas:
        with _routers_lock:
            router = _routers.get(replicas.deployment)
            if router is None or router.replicas is not replicas:
                router = _routers[replicas.deployment] = Router(replicas, join=join)
    if router.policy is not None and replicas.count > 1:
        _ensure_poller()
    return router


def drop_router(deployment: str) -> None:
    with _routers_lock:
        _routers.pop(deployment, None)


def _poll_forever() -> None:
    while True:
        for router in list(_routers.values()):
            try:
                router.poll_once()
            except Exception:
                logger.exception("router poll failed for %s", router.replicas.deployment)
        time.sleep(POLL_INTERVAL_S)


def _ensure_poller() -> None:
    global _poller
    if _poller is None or not _poller.is_alive():
        with _routers_lock:
            if _poller is None or not _poller.is_alive():
                _poller = threading.Thread(target=_poll_forever, name="strata-router-poll", daemon=True)
                _poller.start()
