"""``runtime.samples.SampleStore`` without Ray: reads never poll on the caller's thread, one poll per
replica at a time and a bounded pool, the last figures kept (stale) when a poll fails, dropped when
the actor is gone, and staleness by age."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from controlplane.runtime import samples
from controlplane.runtime.samples import SampleStore


@dataclass(frozen=True)
class Spec:
    deployment: str


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Replicas:
    """The poll: answers ``answers[(name, replica)]`` (a status, figures pair), blocking while ``gate`` is clear."""

    def __init__(self) -> None:
        self.answers: dict = {}
        self.gate = threading.Event()
        self.gate.set()
        self.threads: list[str] = []
        self.running = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, spec, replica):
        with self._lock:
            self.threads.append(threading.current_thread().name)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            self.gate.wait(10)
            status, snap = self.answers.get((spec.deployment, replica), ("not started", None))
            return status, snap, None if status == "ok" else "no answer"
        finally:
            with self._lock:
                self.running -= 1


def _wait(store: SampleStore, polls: int) -> None:
    deadline = time.monotonic() + 10
    while store.polls < polls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.polls >= polls


def test_a_read_polls_on_the_pool_and_keeps_the_last_figures_when_a_poll_fails():
    replicas, clock = Replicas(), Clock()
    store = SampleStore(poll=replicas, clock=clock)
    a = Spec("a")
    replicas.answers[("a", 0)] = ("ok", {"totals": {"query_tokens": 3}})
    view = store.read([(a, 0)], fresh_s=0, wait_s=10)[("a", 0)]
    assert view["status"] == "ok" and view["stale"] is False and view["totals"] == {"query_tokens": 3}
    assert replicas.threads and "MainThread" not in replicas.threads

    replicas.answers[("a", 0)] = ("unreachable", None)
    clock.now += 5
    view = store.read([(a, 0)], fresh_s=0, wait_s=10)[("a", 0)]
    assert view["status"] == "unreachable" and view["stale"] is True and view["error"] == "no answer"
    assert view["totals"] == {"query_tokens": 3} and view["age_s"] == 5.0  # the last figures, with their age

    replicas.answers[("a", 0)] = ("not started", None)  # the actor is gone: its figures describe nothing
    view = store.read([(a, 0)], fresh_s=0, wait_s=10)[("a", 0)]
    assert view["status"] == "not started" and "totals" not in view and view["sampled_at"] is None


def test_a_sample_older_than_the_bound_is_stale_and_a_fresh_one_is_not_polled_again():
    replicas, clock = Replicas(), Clock()
    store = SampleStore(poll=replicas, clock=clock)
    replicas.answers[("a", 0)] = ("ok", {"totals": {}})
    store.read([(Spec("a"), 0)], fresh_s=0, wait_s=10)
    asked = len(replicas.threads)
    assert store.read([(Spec("a"), 0)], fresh_s=60, wait_s=10)[("a", 0)]["stale"] is False
    assert len(replicas.threads) == asked  # fresh enough: served from the store, no poll
    clock.now += samples.STALE_S + 1
    assert store.read([(Spec("a"), 0)], fresh_s=10_000, wait_s=0)[("a", 0)]["stale"] is True


def test_a_replica_that_does_not_answer_holds_one_poll_and_reads_do_not_wait_for_it():
    replicas = Replicas()
    store = SampleStore(poll=replicas, max_polls=2)
    replicas.gate.clear()  # every poll hangs
    specs = [(Spec("a"), i) for i in range(5)]
    for _ in range(3):
        t0 = time.monotonic()
        views = store.read(specs, fresh_s=0, wait_s=0.05)
        print(f"read of 5 hung replicas: {(time.monotonic() - t0) * 1000:.0f} ms")
        assert {v["status"] for v in views.values()} == {"pending"}
    assert replicas.most <= 2  # the pool bounds the polls
    assert len(replicas.threads) <= 2  # one poll per replica in flight: three reads did not add more
    replicas.gate.set()
    _wait(store, 5)
    assert len(replicas.threads) == 5  # each replica polled once
