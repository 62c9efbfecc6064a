"""The model side of a step: :class:`Advance`, owned by :class:`cachecore.scheduler.loop.Scheduler`
and used by its loop thread only.

``compute`` runs one plan's forwards, one per runner (revisions being rolled out share the loop), and
``_advance`` moves each request on by what its item computed (greedy requests' tokens are picked for
the whole batch at once, ``Runner.greedy_tokens``): a chunk registers its full blocks so
others can hit them; a finished prompt records its prefill, emits ``Prefilled`` (or ``Logits``) and its
first token; a decode emits ``TokenOut`` until a stop or ``max_tokens``. A forward that raises fails
the requests in it (so does the batch's greedy pick); a request whose sampling or bookkeeping raises
fails alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cachecore.scheduler.batch import Plan
from cachecore.scheduler.events import Prefilled, TokenOut
from cachecore.scheduler.request import Logits, Request
from cachecore.scheduler.threads import StepThreads, prompt_only


class Advance:
    """Runs a plan's forwards and moves its requests on. Collaborators: the engine (marks, commits,
    prefill records), the scheduler's ``CachedPrefixes`` index (committed blocks), its counters and
    first-token stats, and its ``finish(req, reason)`` / ``fail(req, exc)``; ``threads``:
    each step's intra-op threads (``threads.py``), None to leave them as they are. ``last_step_s``: the
    forward time of the last step (the longest an anticipation hold lasts)."""

    def __init__(self, engine, *, index, counters, first_tokens, finish: Callable[[Request, Any], None],
                 fail: Callable[[Request, BaseException], None], threads: StepThreads | None = None) -> None:
        self.engine = engine
        self.threads = threads
        self.index = index
        self.counters = counters
        self.first_tokens = first_tokens
        self._finish = finish
        self._fail = fail
        self.last_step_s = 0.0

    def compute(self, plan: Plan) -> None:
        by_runner: dict[int, list] = {}
        for item in plan.items:
            by_runner.setdefault(id(item[0].runner), []).append(item)
        total = plan.tokens
        self.counters["steps"] += 1
        self.counters["tokens"] += total
        if self.threads is not None:
            # see threads.py: a burst would wait at every parallel region for the core the L3 writer holds
            threads = self.threads.enter_step(prompt_only((s, e) for _, s, e in plan.items), self.engine.l3_writing)
            if threads > self.threads.steady:
                self.counters["burst_steps"] += 1
            elif self.threads.last_held:
                self.counters["burst_held"] += 1
        for items in by_runner.values():
            runner = items[0][0].runner
            t0 = time.perf_counter()
            batch_greedy = getattr(runner, "greedy_tokens", None)
            try:
                logits = runner.forward_items([(r.seq, s, e) for r, s, e in items])
                picks = batch_greedy(logits, [r for r, _, _ in items]) if batch_greedy else [None] * len(items)
            except Exception as exc:
                for req, _, _ in items:
                    self._fail(req, exc)
                continue
            seconds = time.perf_counter() - t0
            self.counters["step_seconds"] += seconds
            self.last_step_s = seconds
            n = sum(e - s for _, s, e in items)
            for (req, start, end), row, pick in zip(items, logits, picks, strict=True):
                try:
                    self._advance(req, start, end, row, seconds * (end - start) / n, pick)
                except Exception as exc:  # sampling or bookkeeping failed for this request only
                    self._fail(req, exc)

    def _advance(self, req: Request, start: int, end: int, row, seconds: float, pick: int | None = None) -> None:
        seq = req.seq
        self.engine.mark_computed(seq, end)
        if end - start == 1 and req.prefilled:
            self.counters["decode_tokens"] += 1
        else:
            self.counters["prefill_tokens"] += end - start
        if end < len(seq.tokens):  # a chunk: register its full blocks now so others can hit them
            req.prefill_seconds += seconds
            self._commit(seq)
            return
        if not req.prefilled:
            req.prefill_seconds += seconds
            req.prefilled = True
            self._commit(seq)
            self.engine.record_prefill(seq, seconds=req.prefill_seconds,
                                       computed=max(0, len(req.prompt) - req.cached_tokens))
            if req.logits_only:
                req.emit(Logits(row, req.cached_tokens))
                self._finish(req, None)
                return
            ttft = time.perf_counter() - req.arrival_time
            req.emit(Prefilled(len(req.prompt), req.cached_tokens, ttft))
            self.first_tokens.record(req, ttft)
        elif end - start > 1:  # a preempted request's recompute ended
            self._commit(seq)
        if req.produced >= req.max_tokens:
            self._finish(req, "length")
            return
        token, logprob, top = (pick, None, None) if pick is not None else req.runner.sample(row, req)
        req.produced += 1
        req.emit(TokenOut(token, req.runner.decode_token(token), logprob, top))
        if req.runner.stops(token, req):
            self._finish(req, "stop")
        elif req.produced >= req.max_tokens:
            self._finish(req, "length")
        else:
            self.engine.append_token(seq, token)

    def _commit(self, seq) -> None:
        self.engine.commit(seq)
        if seq.use_cache:
            self.index.add(seq.hashes[: seq.num_registered])
