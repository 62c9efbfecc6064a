"""A request's state inside the scheduler, and the events it hands to the thread that submitted it.

The loop thread is the only writer of a ``Request`` once submitted (except ``cancel``, a flag); the
submitting thread reads events from ``events`` (a thread-safe queue) and waits on ``done``.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cachecore.namespace import Namespace
from cachecore.sequence import CachedSequence


class State(enum.Enum):
    WAITING = "waiting"  # queued (admitted at enqueue when blocks allowed: its prefetch is running)
    RUNNING = "running"  # in the running set: prefilling in chunks, then decoding one token a step
    DONE = "done"  # finished, aborted or failed; its blocks are released


class Runner(Protocol):
    """What the loop needs from a model (``cachecore.runner.CompletionRunner`` is one)."""

    def forward_items(self, items: list[tuple[CachedSequence, int, int]]) -> torch.Tensor:
        """Compute ``seq.tokens[start:end]`` of each item (KV into the pages); the last logits of each
        item, ``[len(items), vocab]`` on the CPU."""

    def sample(self, logits: torch.Tensor, req: Request) -> tuple[int, float | None, dict | None]:
        """The next token of ``req`` from its last logits, with its logprob and top alternatives."""

    def decode_token(self, token: int) -> str: ...

    # optional: ``greedy_tokens(logits, reqs) -> list[int | None]``, the greedy token of each row whose
    # request samples greedily, picked for the whole batch at once (``CompletionRunner.greedy_tokens``)

    def stops(self, token: int, req: Request) -> bool:
        """Whether ``token`` ends ``req`` (an end-of-sequence id, when its parameters stop there)."""


@dataclass(eq=False)
class Request:
    """One generation (or, with ``logits_only``, one prefill whose last logits are returned)."""

    owner: str
    runner: Any  # a Runner
    ns: Namespace
    prompt: list[int]
    max_tokens: int
    admit_kwargs: dict
    chunk: int  # prefill tokens per step at most
    rid: int = 0  # arrival order, set by ``Scheduler.submit``
    params: Any = None  # the runner's sampling parameters
    weight: float = 1.0
    logits_only: bool = False
    should_abort: Any = None  # callable polled each step (client gone, rollout abort)
    # ---- scheduler state (loop thread) ----
    state: State = State.WAITING
    seq: CachedSequence | None = None
    resume: list[int] | None = None  # prompt + generated tokens of a preempted request
    arrival_step: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    started_step: int | None = None  # step of its first chunk (queue wait = started - arrival)
    started_time: float | None = None
    waited_steps: int = 0  # longest queue wait so far (a preempted request waits again)
    requeued_step: int = 0  # step it last entered the waiting queue
    prefilled: bool = False  # the first prefill is done (Prefilled sent)
    produced: int = 0
    cached_tokens: int = 0  # of the first admission (what the client is told)
    cached_by_tier: dict[str, int] | None = None  # of that admission: tokens per tier
    load_stop: str | None = None  # of that admission: why a lower-tier load stopped short
    write_tokens: int = 0  # prompt tokens its admissions added to the cache
    prefill_seconds: float = 0.0  # share of step time spent on its prompt
    preemptions: int = 0
    generator: torch.Generator | None = None
    cancelled: bool = False
    events: queue.Queue = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        """Every token so far: the prompt plus what was generated (the seq's, when admitted)."""
        if self.seq is not None:
            return self.seq.tokens
        return self.resume if self.resume is not None else self.prompt

    def note_cached(self) -> None:
        """Record the first admission's cache outcome (``cached_tokens`` and where it came from)."""
        seq = self.seq
        self.cached_tokens = seq.num_cached_tokens
        self.cached_by_tier = dict(seq.tier_tokens)
        self.load_stop = seq.load_stop

    def remaining_tokens(self) -> int:
        return self.max_tokens - self.produced

    def emit(self, event: Any) -> None:
        self.events.put(event)


@dataclass(frozen=True)
class Failed:
    """The request failed in the loop; ``error`` is re-raised in the submitting thread."""

    error: BaseException


@dataclass(frozen=True)
class Logits:
    """``logits_only`` result: the last prompt token's logits (CPU, fp32)."""

    logits: torch.Tensor
    cached_tokens: int
