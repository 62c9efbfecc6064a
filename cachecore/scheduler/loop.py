"""The scheduler: one loop thread per engine (device) that owns the model forwards.

Callers ``submit`` a ``Request`` and read its events; the loop keeps a waiting queue and a running
set and, each step, computes one batch (``batch.build_batch``): running requests' next decode tokens
plus prefill chunks of waiting or prefilling requests, within ``token_budget`` tokens and at most
``max_batch`` running requests, split fairly between tenants (``fairness``). While two or more
tenants had work within ``contended_window`` steps, a step carries at most ``contended_budget``
tokens (a request arriving mid-step waits for the step in flight); a step carrying the first token of
a tenant below its share carries at most ``lean_budget`` tokens of the others'; when such a tenant's
request finished and it has nothing else queued, the next step waits up to ``anticipate_ms`` for its
next request (``anticipate.py``: a client sending one request after another would otherwise always
land in the step just begun). Requests of different
runners (revisions being rolled out) share the loop; each runner computes its own items of the step.

Admission happens at ``submit`` (``engine.admit``: the L1 hit is held and the L2/L3 prefetch starts
while the request waits) when the pool has room; otherwise the request waits unadmitted and the loop
admits it when it is picked. When the pool has no room for the request picked next, the loop
preempts lower-priority holders (requests that arrived after it): a waiting one
gives back its blocks, a running one is released after committing what it computed and requeued
with its tokens so far, to be recomputed later mostly from the cache. A request needing more blocks
than the pool holds fails with ``OutOfBlocks`` at once; one that cannot be admitted while nothing else
holds blocks fails with it too. ``InflightLimit`` at submit is raised to the caller (as before the
scheduler); a requeued request waits for its tenant's other requests instead.

A request whose prefix was committed (by another request) after it was admitted is re-admitted when
it starts, so it hits that prefix; a request whose prefix a running request is computing is not
admitted at submit at all (the loop admits it when picked). A re-admitted or preempted request is
admitted again, so the engine's query metrics count it once per admission.

Work that is not a forward (``submit_work``: a KV upload's validation and page writes) runs on the
loop thread between steps, never beside a forward, admitted and charged to its tenant by the fair
queue like computed tokens (``work.py``): a tenant below the uploader's share has its step first.

Cancellation (``cancel``, or ``should_abort`` polled every step) releases the request's blocks at
the next step. A forward that raises fails the requests in it (``Failed``, blocks freed without
registering partial KV); the loop keeps serving the others.

The thread starts on the first submission and exits after ``idle_exit_s`` without work (restarted by
the next one), so an unused scheduler holds no thread. With ``start_thread=False`` nothing runs but
explicit ``step`` calls (tests drive it step by step).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

from cachecore.allocator import keep_freed_memory
from cachecore.errors import OutOfBlocks
from cachecore.hashing import chain_hashes
from cachecore.scheduler.admission import Admission
from cachecore.scheduler.advance import Advance
from cachecore.scheduler.anticipate import Anticipation
from cachecore.scheduler.batch import build_batch
from cachecore.scheduler.events import Finished
from cachecore.scheduler.fairness import RecentTenants, step_budget
from cachecore.scheduler.queue import CachedPrefixes, FairQueue
from cachecore.scheduler.request import Failed, Request, State
from cachecore.scheduler.settings import SchedulerSettings
from cachecore.scheduler.stats import FirstTokenStats
from cachecore.scheduler.threads import StepThreads
from cachecore.scheduler.work import Work, WorkQueue

_DEFAULTS = SchedulerSettings()

_EXITING = threading.Event()  # the interpreter is shutting down: loop threads stop after their step
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_loops() -> None:
    """Let every loop thread finish its step before the interpreter goes away (a daemon thread killed
    inside a torch kernel aborts the process)."""
    _EXITING.set()
    for sched in list(_LIVE):
        with sched._cond:
            sched._cond.notify_all()
            thread = sched._thread
        if thread is not None:
            thread.join(timeout=10)
        sched.work.fail_all(RuntimeError("the scheduler stopped: the process is exiting"))


class Scheduler:
    """Continuous batching over one ``CacheEngine`` (see the module docstring). Thread-safe API:
    ``submit``, ``submit_work``, ``cancel``, ``set_weight``, ``snapshot``; everything else is the loop thread's,
    ``admission`` (``admission.Admission``: admits and preempts for the batch builder) and ``advance``
    (``advance.Advance``: runs a plan's forwards and moves its requests on) included."""

    def __init__(self, engine, *, token_budget: int = _DEFAULTS.token_budget, max_batch: int = _DEFAULTS.max_batch,
                 age_steps: int = _DEFAULTS.age_steps, policy: str = _DEFAULTS.policy, idle_exit_s: float = 5.0,
                 start_thread: bool = True, quantum: int = _DEFAULTS.quantum,
                 lean_budget: int = _DEFAULTS.lean_budget, contended_budget: int = _DEFAULTS.contended_budget,
                 contended_window: int = _DEFAULTS.contended_window,
                 anticipate_ms: int = _DEFAULTS.anticipate_ms, threads: StepThreads | None = None) -> None:
        """Settings as in ``SchedulerSettings`` (``ValueError`` when one is invalid); ``threads``: each
        step's intra-op threads (``threads.py``), None to leave torch's as they are."""
        self.settings = SchedulerSettings(
            token_budget=token_budget, max_batch=max_batch, age_steps=age_steps, policy=policy, quantum=quantum,
            lean_budget=lean_budget, contended_budget=contended_budget, contended_window=contended_window,
            anticipate_ms=anticipate_ms)
        self.anticipation = Anticipation(anticipate_ms / 1000)
        keep_freed_memory()  # every forward runs on the loop thread, off the main heap (``cachecore.allocator``)
        self.engine = engine
        self.token_budget, self.max_batch, self.age_steps, self.policy = token_budget, max_batch, age_steps, policy
        self.lean_budget, self.contended_budget = lean_budget, contended_budget
        self.recent = RecentTenants(contended_window)
        self.idle_exit_s = idle_exit_s
        self.start_thread = start_thread  # False: nobody runs the loop but explicit ``step`` calls
        self.block_size = engine.block_size
        self.fair = FairQueue(quantum=quantum)
        self.index = CachedPrefixes()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_no = 0
        # steps, tokens, decode_tokens, prefill_tokens, preemptions, deferred, lean_steps, contended_steps,
        # max_wait_steps, step_seconds (forward time of every step), work_jobs, work_tokens (charged),
        # work_seconds (jobs run between steps: ``submit_work``), holds (``anticipate.py``: waits before a
        # step), held_arrivals (the tenant held for arrived within the hold), burst_steps (steps of prompt
        # chunks only, run on more threads: ``threads.py``), burst_held (such steps kept on the steady
        # threads because L3 chunks were being written)
        self.counters: Counter[str] = Counter()
        self.first_tokens = FirstTokenStats()  # per tenant: scheduling delay vs step time of first tokens
        self.max_wait_seconds = 0.0
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self.work = WorkQueue()  # jobs run between steps (``submit_work``)
        # prompt blocks running requests will compute and have not committed yet (replaced each step)
        self._computing: frozenset[bytes] = frozenset()
        self._weights: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._rids = 0
        self.admission = Admission(engine, index=self.index, block_size=self.block_size,
                                   holders=lambda: [*self.waiting, *self.running], requeue=self._requeue,
                                   fail=self._fail)
        self.advance = Advance(engine, index=self.index, counters=self.counters, first_tokens=self.first_tokens,
                               finish=self._finish, fail=self._fail, threads=threads)

    # ------------------------------------------------------------------ caller side
    def set_weight(self, owner: str, weight: float) -> None:
        """Fair-queue weight of ``owner`` (default 1; e.g. from its quota). ``ValueError`` unless > 0."""
        FairQueue().set_weight(owner, weight)  # validate in the caller's thread
        with self._cond:
            self._weights[owner] = float(weight)
            self._cond.notify_all()

    def submit(self, req: Request) -> Request:
        """Queue ``req``, admitting it now when the pool has room (so its prefetch overlaps the wait)
        unless a running request is computing part of its prefix (then the loop admits it later, to
        hit that). Raises ``OutOfBlocks`` when it needs more blocks than the pool holds and
        ``InflightLimit`` when admitted now while its tenant holds its in-flight share; nothing is
        held then."""
        bs, pool = self.block_size, self.engine.pool
        need = -(-(len(req.prompt) + req.max_tokens) // bs)
        if need > pool.num_blocks:
            raise OutOfBlocks(f"this request needs {need} blocks of KV but the pool holds {pool.num_blocks}; "
                              "send a shorter prompt or fewer max_tokens")
        hashes = []
        if req.admit_kwargs.get("use_cache", True):
            hashes = chain_hashes(req.ns, req.prompt, bs, request_salt=req.admit_kwargs.get("request_salt", b""))
        limit = (len(req.prompt) - 1) // bs
        if any(h in self._computing for h in hashes[:limit]):
            # a running request is computing part of this prefix: admitting now would miss what it is
            # about to commit, so the loop admits this one when it is picked (and it hits)
            req.extra["hashes"] = hashes
        else:
            try:
                req.seq = self.engine.admit(req.ns, req.prompt, owner=req.owner, max_new_tokens=req.max_tokens,
                                            **req.admit_kwargs)
                req.extra["counted"] = True  # its later admissions (preempted, re-admitted) are not counted again
                req.note_cached()
            except OutOfBlocks:  # waits unadmitted; the loop admits it (preempting if it must) when picked
                req.seq = None
                req.extra["hashes"] = hashes
        with self._cond:
            self._rids += 1
            req.rid = self._rids
            req.arrival_time = time.perf_counter()
            self._incoming.append(req)
            self._start_thread()
            self._cond.notify_all()
        return req

    def submit_work(self, owner: str, tokens: int, fn: Callable[[], object], *,
                    weight: float | None = None) -> Future:
        """Run ``fn()`` on the loop thread between two steps (never while a forward runs) and charge
        ``owner`` ``tokens`` in the fair queue when it runs; ``weight`` (optional) sets ``owner``'s
        share as ``set_weight`` does. Returns a future of ``fn``'s result or exception. Order against
        other tenants' requests and jobs: ``work.WorkQueue.take``. ``ValueError`` for a bad ``tokens``
        or ``weight``; ``RuntimeError`` when the process is exiting."""
        if weight is not None:
            self.set_weight(owner, weight)
        if _EXITING.is_set():
            raise RuntimeError("the scheduler stopped: the process is exiting")
        future = self.work.submit(Work(owner=owner, tokens=tokens, fn=fn))
        with self._cond:
            self._start_thread()
            self._cond.notify_all()
        return future

    def _start_thread(self) -> None:  # caller holds self._cond
        if self._thread is None and self.start_thread and not _EXITING.is_set():
            self._thread = threading.Thread(target=self._run, name="strata-scheduler", daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def cancel(self, req: Request, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop ``req`` at the next step (its blocks are released, computed KV committed). With
        ``wait``, return once that happened."""
        req.cancelled = True
        with self._cond:
            self._cond.notify_all()
        if wait:
            req.done.wait(timeout)

    def snapshot(self) -> dict:
        """Counters as plain data; ``tenants``: each tenant's first-token latency sums (see ``latency``)."""
        return {"steps": self.step_no, "waiting": len(self.waiting), "running": len(self.running),
                "max_wait_seconds": round(self.max_wait_seconds, 6), "lean_budget": self.lean_budget,
                "contended_budget": self.contended_budget,
                "anticipate_ms": self.settings.anticipate_ms, **self.counters,
                "step_seconds": round(self.counters["step_seconds"], 6),
                "work_seconds": round(self.counters["work_seconds"], 6), "tenants": self.first_tokens.snapshot()}

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_work() or _EXITING.is_set():
                    if _EXITING.is_set() or (not self._cond.wait(self.idle_exit_s) and not self._has_work()):
                        self._thread = None
                        return
            try:
                worked = self.step()
            except BaseException as exc:  # a bug in the loop: fail everything rather than hang callers
                for req in [*self.waiting, *self.running]:
                    self._fail(req, exc)
                worked = True
            if not worked:  # only prefetches in flight: wait for them (or a new request)
                with self._cond:
                    self._cond.wait(0.002)
            elif (expected := self.anticipation.take()) is not None:
                self._hold(*expected)

    def _hold(self, owner: str, seconds: float) -> None:
        """Wait up to ``seconds`` before the next step, unless ``owner``'s next request arrives first.
        Never longer than the last step took: a hold that outlasts a step costs the others more than
        the step in flight would have cost ``owner`` (so on a fast device the hold is short too)."""
        deadline = time.perf_counter() + min(seconds, self.advance.last_step_s)
        with self._cond:
            while not (arrived := any(r.owner == owner for r in self._incoming)) and not _EXITING.is_set():
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
        self.counters["holds"] += 1
        self.counters["held_arrivals"] += int(arrived)

    def _has_work(self) -> bool:  # caller holds self._cond
        return bool(self._incoming or self.waiting or self.running or self.work.pending())

    def step(self) -> bool:
        """One step: take new requests, drop aborted ones, run the jobs whose turn it is
        (``submit_work``), compute one batch. Returns whether a batch or a job ran (False: nothing to
        do, or every waiting request waits for its prefetch or blocks)."""
        with self._cond:
            new, self._incoming = self._incoming, []
            for owner, w in self._weights.items():
                self.fair.set_weight(owner, w)
        for req in new:
            req.arrival_step = req.requeued_step = self.step_no
            self.fair.activate(req.owner)
            self.waiting.append(req)
        for req in [*self.waiting, *self.running]:
            if req.cancelled or (req.should_abort is not None and req.should_abort()):
                self._finish(req, "aborted")
        jobs = self.work.owners(self.step_no)
        for owner in jobs:
            self.fair.activate(owner)  # no-op while it has work: its virtual time stands
        requesting = {r.owner for r in [*self.waiting, *self.running]}
        recent = self.recent.note(requesting | jobs, self.step_no)
        budget = step_budget(self.token_budget, recent=recent, contended_budget=self.contended_budget)
        if not (self.waiting or self.running):
            ran = self._run_work(requesting, budget)
            self.fair.forget_idle(self.work.owners(self.step_no))
            return ran
        self._computing = self._uncommitted()  # the running set changed (aborts, finishes)
        self.counters["contended_steps"] += int(budget < self.token_budget)
        plan = build_batch(
            self.running, self.waiting, step=self.step_no, token_budget=budget, urgent_budget=self.token_budget,
            max_batch=self.max_batch, fair=self.fair, policy=self.policy, age_steps=self.age_steps,
            index=self.index, block_size=self.block_size, try_start=self.admission.try_start, computing=self._computing,
            lean_budget=self.lean_budget,
        )
        self.counters["deferred"] += plan.deferred
        self.counters["lean_steps"] += int(plan.lean)
        if not plan.items:  # every waiting request waits for its prefetch or blocks: the jobs' turn
            return self._run_work(requesting, budget)
        now = time.perf_counter()
        for req in plan.started:
            self.waiting.remove(req)
            self.running.append(req)
            req.state = State.RUNNING
            req.started_step = self.step_no
            wait = self.step_no - req.requeued_step
            req.waited_steps = max(req.waited_steps, wait)
            self.counters["max_wait_steps"] = max(self.counters["max_wait_steps"], wait)
            if req.started_time is None:
                req.started_time = now
                self.max_wait_seconds = max(self.max_wait_seconds, now - req.arrival_time)
        self.advance.compute(plan)
        self.step_no += 1
        self._computing = self._uncommitted()
        # the jobs' turn right after the step (a finished request's tenant is no longer in their way),
        # but not ahead of a request that arrived during it
        with self._cond:
            arriving = {r.owner for r in self._incoming}
        self._run_work({r.owner for r in [*self.waiting, *self.running]}, budget, arriving)
        self.fair.forget_idle({r.owner for r in [*self.waiting, *self.running]} | self.work.owners(self.step_no))
        return True

    def _run_work(self, requesting: set[str], budget: int, arriving: set[str] = frozenset()) -> bool:
        """Run the jobs whose turn it is before the next step (``work.WorkQueue.run``). Returns whether one ran."""
        done = self.work.run(self.fair, requesting, step=self.step_no, age_steps=self.age_steps, budget=budget,
                             arriving=arriving)
        self.counters.update(done)
        return done["work_jobs"] > 0

    def _uncommitted(self) -> frozenset[bytes]:
        return frozenset(h for r in self.running if r.seq is not None and r.seq.use_cache
                         for h in r.seq.hashes[r.seq.num_registered:])

    # ------------------------------------------------------------------ endings
    def _requeue(self, req: Request) -> None:
        """A preempted running request waits again (``Admission.preempt`` then releases its blocks)."""
        self.running.remove(req)
        self.waiting.append(req)
        req.state = State.WAITING
        req.requeued_step = self.step_no
        req.preemptions += 1
        self.counters["preemptions"] += 1

    def _detach(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.state = State.DONE

    def _finish(self, req: Request, reason: str | None) -> None:
        if req.seq is not None:
            self.engine.release(req.seq)
            req.write_tokens += req.seq.written_tokens
            if req.seq.use_cache:
                self.index.add(req.seq.hashes[: req.seq.num_registered])
        self._detach(req)
        if reason is not None:
            req.emit(Finished(reason, len(req.prompt), req.produced, req.cached_tokens,
                              cached_by_tier=req.cached_by_tier, load_stop=req.load_stop,
                              write_tokens=req.write_tokens))
        req.done.set()
        if reason in ("stop", "length"):
            others = {r.owner for r in [*self.waiting, *self.running]} | self.work.owners(self.step_no)
            others.discard(req.owner)
            busy = any(r.owner == req.owner for r in [*self.waiting, *self.running])
            self.anticipation.finished(req.owner, busy=busy, vtime=self.fair.vtime(req.owner),
                                       others={o: self.fair.vtime(o) for o in others})

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.seq is not None:
            self.engine.abort(req.seq)
        self._detach(req)
        req.emit(Failed(exc))
        req.done.set()
