"""FairTurns: the model is handed out fairly among tenants, not to whoever grabs a lock first."""

from __future__ import annotations

import threading
import time

import pytest

from cachecore.turns import FairTurns


def _waiter(turns: FairTurns, owner: str, order: list[str], started: threading.Event | None = None):
    def run():
        if started is not None:
            started.set()
        with turns.turn(owner):
            order.append(owner)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_for_waiters(turns: FairTurns, n: int) -> None:
    deadline = time.monotonic() + 10
    while turns.waiting() < n:
        assert time.monotonic() < deadline, "waiters never queued"
        time.sleep(0.001)


def test_a_light_tenant_goes_next_even_behind_a_heavy_tenants_queue():
    turns, order = FairTurns(), []
    release = threading.Event()

    def heavy_holder():
        with turns.turn("heavy"):
            order.append("heavy")
            release.wait(10)

    holder = threading.Thread(target=heavy_holder)
    holder.start()
    _wait_for_waiters(turns, 0)
    while not order:
        time.sleep(0.001)
    queued = [_waiter(turns, "heavy", order) for _ in range(3)]
    _wait_for_waiters(turns, 3)
    light = _waiter(turns, "light", order)
    _wait_for_waiters(turns, 4)
    release.set()
    for t in [holder, light, *queued]:
        t.join(10)
    assert order[:2] == ["heavy", "light"]  # the light tenant did not wait for the three queued turns
    assert order.count("heavy") == 4 and turns.turns_granted == 5


def test_one_tenant_alone_is_first_come_first_served():
    turns, order = FairTurns(), []
    gate = threading.Event()

    def first():
        with turns.turn("a"):
            order.append("a0")
            gate.wait(10)

    t0 = threading.Thread(target=first)
    t0.start()
    while not order:
        time.sleep(0.001)
    threads = []
    for i in range(1, 4):
        def run(i=i):
            with turns.turn("a"):
                order.append(f"a{i}")
        threads.append(threading.Thread(target=run))
        threads[-1].start()
        _wait_for_waiters(turns, i)
    gate.set()
    for t in [t0, *threads]:
        t.join(10)
    assert order == ["a0", "a1", "a2", "a3"]


def test_weights_must_be_positive():
    with pytest.raises(ValueError):
        FairTurns().set_weight("a", 0)
