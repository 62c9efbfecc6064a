"""Named caches on a replica (the engine side of a tenant's prewarmed, soft-pinned prefixes):
``prewarm``, ``cache_pin``, ``cache_drop`` and ``cache_resident``, on both engines
(``workers.engine_contract``).

Every operation takes a ``workers.protocol.WorkerRequest`` dict, and its block keys are the ones a
completion of that prompt computes on this replica (the active revision's namespace under the
request's ``scope_salt``, narrowed by its ``cache_salt``), so a later completion sending the same
prefix hits the pinned blocks. ``tiers`` are tokens of the prompt's contiguous full-block prefix each
tier holds (``{"l1", "l2", "l3"}``), except in ``cache_drop``, which counts what it deleted: blocks
in L1 and L2, objects in L3.

- ``prewarm(req, pin_until)``: serve ``req`` through the normal path (admission, quotas; the caller
  sets ``max_tokens`` 1), wait until its writes to L2 and L3 landed, pin the prompt's full blocks
  until ``pin_until`` (unix time; None: no pin). ``{"tokens", "cached_tokens", "tiers", "pinned",
  "usage"}`` (``usage``: the run's, as its finished event had it), or ``{"error": {"code", "message",
  "retryable"}}`` when the run ended with an error event, with ``usage`` too when the run was stopped
  (cancelled: its client went away) and its engine said what it had written by then.
- ``cache_pin(req, pin_until)``: (re)pin, or with None unpin, the prompt's blocks: ``{"tiers"}``.
- ``cache_drop(req)``: delete the prompt's full blocks from every tier of this replica and the L3
  objects covering them (the bytes leave the backend), and unpin: ``{"tiers", "bytes"}``. Idempotent.
  Raises ``BackendUnavailable`` when L3 could not be reached (the caller retries).
- ``cache_resident(req)``: ``{"tiers"}``.

Pins are soft (``cachecore.block_pool``): pinned blocks are evicted after their tenant's unpinned
ones, never at another tenant's fair share, and lapse by themselves at ``pin_until``. They live in
this replica's memory: a replica that started anew has none until the control plane pins its caches again
(``controlplane.caches.repin``, at the stats sampler's next poll after the restart).

:class:`StrataNamedCaches` is the reference engine's (``CacheWorker``: L1, L2 and L3 of its
``CacheEngine``); :class:`VllmNamedCaches` the vLLM replica's, whose device cache (L1) is vLLM's own
and cannot be edited per block from outside: its ``l1`` is what the replica recorded vLLM computing
(``workers.vllm_blocks``, an estimate), pins and deletes reach only Strata's L2 and L3 in the tier
service (``workers.kv_tiers``), and a dropped prefix may still hit in vLLM's device cache until vLLM
evicts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cachecore.routing.hashes import request_salt
from workers.protocol import WorkerRequest

if TYPE_CHECKING:  # the vLLM replica imports this module and loads no reference-engine model
    from workers.revisions import RevisionManager


def _outcome(events: list[dict]) -> tuple[dict | None, int, dict | None]:
    """(the error of a run as ``{"code", "message", "retryable"}`` or None, its cached tokens, the
    usage the control plane's ledger counts: the finished event's, or what a stopped run did before
    it stopped, when its error event says)."""
    cached, usage = 0, None
    for ev in events:
        if ev["type"] == "error":
            return {"code": ev["code"], "message": ev["message"], "retryable": ev["retryable"]}, 0, ev.get("usage")
        if ev["type"] == "prefilled":
            cached = ev["cached_tokens"]
        elif ev["type"] == "finished":
            cached, usage = ev["usage"]["cached_tokens"], ev["usage"]
    return None, cached, usage


class StrataNamedCaches:
    """For one ``CacheWorker``. Collaborators: its ``CacheEngine`` (``pin``, ``commit_to_l2``, ``drop``,
    ``resident``, ``drain_writes``), its ``RevisionManager`` (the active revision's namespace), the
    deployment's name, ``learn`` (the worker's: a request's data keys and L3 limits into its L3) and
    ``collect`` (the worker's: every event of one request served the normal way)."""

    def __init__(self, engine, *, revisions: RevisionManager, deployment: str,
                 learn: Callable[[WorkerRequest], None], collect: Callable[[dict], list[dict]]) -> None:
        self.engine, self.revisions, self.deployment = engine, revisions, deployment
        self._learn, self._collect = learn, collect

    def _named(self, req: dict) -> tuple[WorkerRequest, dict]:
        wr = WorkerRequest.from_dict(req)
        self._learn(wr)  # the tenant's data keys (L3 names and reads need them) and limits
        a = self.revisions.active.loaded
        where = {"ns": a.namespace(wr.scope_salt), "tokens": list(wr.prompt),
                 "request_salt": request_salt(wr.cache_salt), "owner": wr.tenant, "model": self.deployment,
                 "revision": a.revision.label}
        return wr, where

    def prewarm(self, req: dict, pin_until: float | None = None) -> dict:
        """Serve ``req`` (max_tokens 1), let its tier writes land, pin its prompt's full blocks until
        ``pin_until`` (None: no pin): ``{"tokens", "cached_tokens", "tiers", "pinned"}`` or
        ``{"error": {"code", "message", "retryable"}}`` (``workers.named_caches``), with the ``usage``
        of what a stopped run wrote."""
        error, cached, usage = _outcome(self._collect(req))
        if error is not None:
            return {"error": error, **({"usage": usage} if usage else {})}
        self.engine.drain_writes()
        wr, where = self._named(req)
        if pin_until is not None:
            tiers = self.engine.pin(until=float(pin_until), **where)
        else:  # committed to L2 before the answer, whatever the write policy (write-back by default)
            tiers = self.engine.commit_to_l2(**where)
        return {"tokens": len(wr.prompt), "cached_tokens": cached, "tiers": tiers, "pinned": pin_until is not None,
                "usage": usage}

    def cache_pin(self, req: dict, pin_until: float | None) -> dict:
        """(Re)pin the prompt's full blocks until ``pin_until`` (None: unpin) in L1, L2 and L3:
        ``{"tiers"}`` (tokens resident per tier)."""
        _, where = self._named(req)
        return {"tiers": self.engine.pin(until=None if pin_until is None else float(pin_until), **where)}

    def cache_drop(self, req: dict) -> dict:
        """Delete the prompt's full blocks from L1, L2 and L3 (objects and bytes) and unpin them:
        ``{"tiers": {"l1": blocks, "l2": blocks, "l3": objects}, "bytes"}``. Idempotent."""
        _, where = self._named(req)
        done = self.engine.drop(**where)
        return {"tiers": done["tiers"], "bytes": done["bytes"]}

    def cache_resident(self, req: dict) -> dict:
        """``{"tiers": {"l1", "l2", "l3"}}``: tokens of the prompt's full-block prefix each tier holds."""
        _, where = self._named(req)
        return {"tiers": self.engine.resident(**where)}


class VllmNamedCaches:
    """For one ``VllmWorker`` (its active revision, tier service and derived L1 record)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def _call(self, op: str, req: dict, **kwargs) -> tuple[WorkerRequest, list[bytes], dict | None]:
        w = self.worker
        wr = WorkerRequest.from_dict(req)
        rev = w._active
        hashes = w._hashes(rev, wr)
        reply = None
        if rev.tiers is not None and hashes:
            reply = w._tiers(op, rev, params=w._transfer(rev, wr, hashes), tokens=list(wr.prompt), **kwargs)
        return wr, hashes, reply

    def _tiers(self, hashes: list[bytes], reply: dict | None) -> dict:
        l1 = self.worker.blocks.prefix(hashes) * self.worker._active.block_size
        lower = reply or {"l2": 0, "l3": 0}
        return {"l1": l1, "l2": lower["l2"], "l3": lower["l3"]}

    def prewarm(self, req: dict, pin_until: float | None = None) -> dict:
        error, cached, usage = _outcome(self.worker.collect(req))
        if error is not None:
            return {"error": error, **({"usage": usage} if usage else {})}
        self.worker.drain_writes()
        wr, hashes, reply = self._call("cache_pin" if pin_until is not None else "cache_resident", req,
                                       **({"until": float(pin_until)} if pin_until is not None else {}))
        return {"tokens": len(wr.prompt), "cached_tokens": cached, "tiers": self._tiers(hashes, reply),
                "pinned": pin_until is not None, "usage": usage}

    def cache_pin(self, req: dict, pin_until: float | None) -> dict:
        _, hashes, reply = self._call("cache_pin", req, until=None if pin_until is None else float(pin_until))
        return {"tiers": self._tiers(hashes, reply)}

    def cache_drop(self, req: dict) -> dict:
        _, _, reply = self._call("cache_drop", req)
        reply = reply or {"l2": 0, "l3": 0, "bytes": 0}
        return {"tiers": {"l1": 0, "l2": reply["l2"], "l3": reply["l3"]}, "bytes": reply["bytes"]}

    def cache_resident(self, req: dict) -> dict:
        _, hashes, reply = self._call("cache_resident", req)
        return {"tiers": self._tiers(hashes, reply)}
