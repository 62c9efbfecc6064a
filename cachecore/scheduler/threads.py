"""How many intra-op threads a step's forward runs on: :class:`StepThreads`.

A worker shares its cores with what serves its streams (the loop thread between steps, the threads
reading each request's events, the web tier on a small machine), so its forwards run on every core but
one (``WorkerConfig.compute_threads``): a step with decodes in it is short, and a second compute thread
waits at every parallel region for a core that one of those holds (on 2 cores shared with the web tier,
16 streams over HTTP: 218-222 tok/s on one thread per step, 188-192 on two). A step of prompt chunks
alone is another matter: nothing is streaming tokens through it (every request in it is still before
its first token), its matmuls are tall, and the first tokens of every request in it wait for the whole
step. Such a step runs on ``burst`` threads (every core on a CPU), then the next step with a decode
goes back to ``steady``. On a GPU both are the same (``WorkerConfig.step_threads``).

While L3 chunks are being written in the background (sealed and fsynced: ``CacheEngine.l3_writing``,
``TierService.writing`` under vLLM; each engine's loop passes its check as ``enter_step``'s ``held``, so the
rule is here once), a step of prompt chunks stays on ``steady`` too: a forward split
over every core waits at each parallel region for the core that work holds. Measured under vLLM on 2
cores, a warm request sent right after a cold one: first output p50 69.7 ms (up to 174) with the burst,
34.2 ms without.

Measured on 2 cores (``bench.model``, the runner as the worker runs it, 2,048-token prompt in 256-token
chunks): prefill 1,416 tok/s on one thread, 2,556 with bursts (and one OpenMP pool in the process,
``cachecore.passing_thread``), decode unchanged (48.6-49.8 tok/s).

The thread count is the calling thread's (OpenMP's per-thread setting; torch keeps it per thread), so
``enter`` must be called on the thread that runs the forwards: the scheduler's loop thread, or vLLM's
worker thread (``workers.kv_connector``, which applies the same rule to vLLM's steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def prompt_only(spans: Iterable[tuple[int, int]]) -> bool:
    """Does a step whose items compute positions ``start..end`` carry prompt chunks only (every item
    more than one position: no decode, no one-token item)?"""
    return all(end - start > 1 for start, end in spans)


class StepThreads:
    """``steady`` threads for a step with a decode (one new token of a request past its prompt) or a
    one-token item, ``burst`` threads for a step of prompt chunks only. Not thread-safe: the loop's."""

    def __init__(self, steady: int, burst: int, *, set_threads: Callable[[int], None] | None = None) -> None:
        for name, value in (("steady", steady), ("burst", burst)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} threads must be a positive int, got {value!r}")
        if burst < steady:
            raise ValueError(f"burst threads ({burst}) must be at least the steady ones ({steady})")
        self.steady, self.burst = steady, burst
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op: it passes torch's own setter
        self._set = set_threads
        self._current: int | None = None
        self.last_held = False  # the last step could have burst but was held (``enter_step``'s ``held``)

    def threads_for(self, spans: Iterable[tuple[int, int]]) -> int:
        """The threads for a step whose items compute positions ``start..end`` (``(start, end)`` each)."""
        return self.burst if prompt_only(spans) else self.steady

    def enter(self, spans: Iterable[tuple[int, int]]) -> int:
        """Set this thread's intra-op threads for the step (only when they change); returns them."""
        return self.enter_step(prompt_only(spans))

    def enter_step(self, prompt_only: bool, held: Callable[[], bool] | None = None) -> int:
        """``enter`` for a step already known to compute prompt chunks only (``prompt_only``) or not.
        ``held``: is background work holding a core now (an L3 chunk being written)? Asked only when the
        step could burst; a step it holds stays on ``steady`` threads and sets ``last_held``."""
        self.last_held = bool(prompt_only and self.burst > self.steady and held is not None and held())
        want = self.burst if prompt_only and not self.last_held else self.steady
        if want != self._current:
            (self._set or torch.set_num_threads)(want)
            self._current = want
        return want
