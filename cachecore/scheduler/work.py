"""Work beside the forwards: jobs a tenant makes the engine do that are not model steps (KV uploads).

Engine-independent (no engine, model or request type here). A caller ``submit``s a ``Work`` (its
tenant, the tokens it is charged, a function) from any thread and waits on its ``Future``; the
scheduler's loop thread runs it *between* steps, so it never overlaps a forward and never competes
with one for the cores, and charges its tokens to its tenant in the same fair queue as computed
tokens. Which runs when (``WorkQueue.take``):

- a tenant's next job runs only while no *other* tenant with requests in the scheduler is below it in
  virtual time (tokens served divided by weight): a victim whose request waits for its first token
  (an idle tenant that just arrived starts a quantum behind) is served its step first, and the
  flooder's uploads wait for it like the flooder's own chunks do;
- jobs run right after a step (so a request that finished in it is out of their way), or when no
  request can step; a tenant whose new request arrived during the step counts as below every other;
- between two steps, jobs run until their tokens reach the step's token bound (at least one job), so
  the wait a job adds to the next step is bounded like a step;
- a job that waited ``age_steps`` steps runs regardless (the aging bound of requests, for work too).

A job's exception is set on its future; the loop goes on.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cachecore.scheduler.queue import FairQueue


@dataclass
class Work:
    """One job: ``fn()`` runs on the loop thread; ``tokens`` is what its tenant is charged (>= 0)."""

    owner: str
    tokens: int
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    arrival_step: int = -1  # set by the queue when the loop first sees it


class WorkQueue:
    """Per-tenant FIFO of jobs. ``submit`` and ``pending`` are thread-safe; ``take`` is the loop's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_owner: dict[str, deque[Work]] = {}

    def submit(self, work: Work) -> Future:
        if isinstance(work.tokens, bool) or not isinstance(work.tokens, int) or work.tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {work.tokens!r}")
        with self._lock:
            self._by_owner.setdefault(work.owner, deque()).append(work)
        return work.future

    def pending(self) -> int:
        """Jobs queued, not yet taken."""
        with self._lock:
            return sum(len(q) for q in self._by_owner.values())

    def owners(self, step: int) -> set[str]:
        """Tenants with jobs queued; stamps jobs seen for the first time with ``step`` (their arrival)."""
        with self._lock:
            for queue in self._by_owner.values():
                for work in queue:
                    if work.arrival_step < 0:
                        work.arrival_step = step
            return set(self._by_owner)

    def take(self, *, vtime: Callable[[str], float], requesting: Mapping[str, float], step: int,
             age_steps: int, budget: int, spent: int) -> Work | None:
        """The job to run next, or None. ``vtime(owner)``: the fair queue's virtual time; ``requesting``:
        the virtual time of each tenant with requests waiting or running; ``spent``: tokens of jobs
        already run since the last step (the first job always fits ``budget``)."""
        with self._lock:
            best = None
            for owner, queue in self._by_owner.items():
                head = queue[0]
                overdue = head.arrival_step >= 0 and step - head.arrival_step >= age_steps
                if spent and spent + head.tokens > budget and not overdue:
                    continue
                mine = vtime(owner)
                behind = [v for o, v in requesting.items() if o != owner]
                if not overdue and behind and min(behind) < mine:
                    continue  # a tenant below this one has requests: its step goes first
                key = (not overdue, mine, owner)
                if best is None or key < best[0]:
                    best = (key, owner)
            if best is None:
                return None
            queue = self._by_owner[best[1]]
            work = queue.popleft()
            if not queue:
                del self._by_owner[best[1]]
            return work

    def run(self, fair: FairQueue, requesting: set[str], *, step: int, age_steps: int, budget: int,
            arriving: set[str] | frozenset[str] = frozenset()) -> Counter[str]:
        """On the loop thread, between steps: run the jobs ``take`` picks (``requesting``: tenants with
        requests waiting or running; ``arriving``: tenants whose new request the loop has not taken yet,
        counted as below every job's tenant), each charged to its tenant in ``fair`` as computed tokens.
        Returns ``work_jobs``, ``work_tokens`` (charged) and ``work_seconds`` of the jobs run."""
        done: Counter[str] = Counter()
        vtimes = {o: fair.vtime(o) for o in requesting}
        vtimes.update({o: float("-inf") for o in arriving})
        spent = 0
        while (work := self.take(vtime=fair.vtime, requesting=vtimes, step=step, age_steps=age_steps,
                                 budget=budget, spent=spent)) is not None:
            if not work.future.set_running_or_notify_cancel():
                continue  # its caller cancelled it before it ran
            t0 = time.perf_counter()
            try:
                result = work.fn()
            except BaseException as exc:  # the job's own failure: its caller gets it, the loop goes on
                work.future.set_exception(exc)
            else:
                work.future.set_result(result)
            done["work_seconds"] += time.perf_counter() - t0
            fair.grant(work.owner)
            fair.charge(work.owner, work.tokens)
            done["work_jobs"] += 1
            done["work_tokens"] += work.tokens
            spent += max(1, work.tokens)
        return done

    def fail_all(self, exc: BaseException) -> None:
        """Fail every queued job (the loop is going away)."""
        with self._lock:
            jobs = [w for q in self._by_owner.values() for w in q]
            self._by_owner.clear()
        for work in jobs:
            if work.future.set_running_or_notify_cancel():
                work.future.set_exception(exc)
