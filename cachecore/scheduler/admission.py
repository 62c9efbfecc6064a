"""Admission and preemption of the scheduler's waiting requests (run on the loop thread only).

``Admission.try_start`` makes a waiting request computable: admitted (preempting younger holders when
the pool or its tenant's in-flight share has no room, and only when that makes room), its lower-tier
prefetch landed (or past its deadline), and re-admitted once more when the cache now holds a longer
prefix of it than its admission found (another request committed it meanwhile). A preempted running
request is released after committing what it computed and requeued with its tokens so far.

:class:`Admission` has no state of its own. Its collaborators: the ``CacheEngine`` (``admit``,
``finish_loads``, ``release``, ``running``, its load deadline and free blocks), the scheduler's
``CachedPrefixes`` index and block size, and three of the scheduler's callbacks: ``holders()`` (its
waiting and running requests), ``requeue(req)`` (a running request back to waiting, counted as a
preemption) and ``fail(req, exc)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cachecore.errors import InflightLimit, OutOfBlocks
from cachecore.scheduler.batch import Plan
from cachecore.scheduler.queue import CachedPrefixes
from cachecore.scheduler.request import Request, State

_READMITS = 8  # re-admissions for a longer hit per request at most (the index is only an estimate)


def priority(req: Request) -> int:
    """Smaller is more important: older. Only younger requests are preempted for a request, so two
    requests never take blocks from each other in turn."""
    return req.rid


def free_blocks(engine) -> int:
    """The engine's free L1 blocks: the one place the scheduler reads its block pool for them."""
    return engine.pool.num_free


class Admission:
    """Admits the request the batch builder picks (``try_start``), preempting for it (module docstring)."""

    def __init__(self, engine, *, index: CachedPrefixes, block_size: int, holders: Callable[[], list[Request]],
                 requeue: Callable[[Request], None], fail: Callable[[Request, BaseException], None]) -> None:
        self.engine, self.index, self.block_size = engine, index, block_size
        self._holders, self._requeue, self._fail = holders, requeue, fail

    def try_start(self, req: Request, plan: Plan) -> bool:
        """Whether ``req`` can compute in this step's ``plan`` (admitting it and preempting for it)."""
        if req.seq is None and not self._admit(req, plan):
            return False
        seq = req.seq
        if seq.pending is not None:
            if not seq.pending.done() and time.perf_counter() - seq.load_started < self.engine.config.load_deadline_s:
                return False  # its prefetch is still arriving: others go first
            self.engine.finish_loads(seq)
            if not req.prefilled:
                req.note_cached()
        if seq.use_cache and seq.num_computed == seq.num_cached_tokens and req.extra.get("readmits", 0) < _READMITS:
            limit = (len(seq.tokens) - 1) // self.block_size
            if self.index.prefix_blocks(seq.hashes, limit) * self.block_size > seq.lookup_hit_tokens:
                # another request committed more of this prefix since admission: admit again to hit it
                req.extra["readmits"] = req.extra.get("readmits", 0) + 1
                self.engine.release(seq)
                req.seq = None
                if not self._admit(req, plan):
                    return False
                if req.seq.pending is not None:
                    return False
        return True

    def _admit(self, req: Request, plan: Plan) -> bool:
        tokens = list(req.tokens)
        planned = {id(r) for r, _, _ in plan.items}
        while True:
            try:
                req.seq = self.engine.admit(req.ns, tokens, owner=req.owner, max_new_tokens=req.remaining_tokens(),
                                            count_query=not req.extra.get("counted"), **req.admit_kwargs)
                req.extra["counted"] = True  # preempted or re-admitted later: one request, one query
                break
            except InflightLimit:  # its tenant's own younger holders give way; older ones finish first
                victim = self._victim(req, planned, owner=req.owner)
                if victim is None:
                    return False
                self.preempt(victim)
            except OutOfBlocks:
                victim = self._victim(req, planned, need=-(-(len(tokens) + req.remaining_tokens()) // self.block_size))
                if victim is None:
                    holders = any(r.seq is not None for r in self._holders() if r is not req)
                    if not holders and not self.engine.running():
                        self._fail(req, OutOfBlocks("the KV pool cannot hold this request even with nothing else "
                                                    "running; send a shorter prompt or fewer max_tokens"))
                    return False
                self.preempt(victim)
        if not req.prefilled:
            req.note_cached()
        return True

    def _victim(self, req: Request, planned: set[int], owner: str | None = None,
                need: int | None = None) -> Request | None:
        """The holder to preempt for ``req``: younger, not in this step's plan, ``owner``'s when given;
        None when there is none, or (``need``: blocks) when even all of them would not make room."""
        mine = priority(req)
        holders = [r for r in self._holders()
                   if r is not req and r.seq is not None and id(r) not in planned and priority(r) > mine
                   and owner in (None, r.owner)]
        if not holders:
            return None
        if need is not None and free_blocks(self.engine) + sum(len(r.seq.blocks) for r in holders) < need:
            return None  # preempting would not make room: keep everyone's progress
        # a waiting holder gives back blocks it has not computed with; then the youngest running one
        return max(holders, key=lambda r: (r.state is State.WAITING, priority(r)))

    def preempt(self, req: Request) -> None:
        """Take ``req``'s blocks back: a running request is requeued (``requeue``) with its tokens so far."""
        seq = req.seq
        if req.state is State.RUNNING:
            req.resume = list(seq.tokens)
            self._requeue(req)
        self.engine.release(seq)  # commits what it computed: the recompute mostly hits
        req.write_tokens += seq.written_tokens
        if seq.use_cache:
            self.index.add(seq.hashes[: seq.num_registered])
        req.seq = None
