"""FairGate: at most ``capacity`` requests inside the engine, a freed slot to the waiting tenant with
the fewest running requests per share weight, work conserving, cancellable waits."""

from __future__ import annotations

import threading
import time

import pytest

from workers.fair_gate import FairGate


def _start(gate: FairGate, tenant: str, order: list, weight: int = 1, stop=lambda: False):
    def run():
        if gate.acquire(tenant, weight, should_stop=stop):
            order.append(tenant)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_waiting(gate: FairGate, n: int) -> None:
    deadline = time.monotonic() + 5
    while gate.waiting() < n:
        assert time.monotonic() < deadline, "waiters did not queue"
        time.sleep(0.005)


def test_a_lone_tenant_uses_every_slot():
    gate = FairGate(3)
    assert all(gate.acquire("a") for _ in range(3))
    assert gate.running_of("a") == 3


def test_a_freed_slot_goes_to_the_tenant_below_its_share_not_the_flooder():
    gate = FairGate(2)
    gate.acquire("flood")
    gate.acquire("flood")
    order: list[str] = []
    threads = [_start(gate, "flood", order) for _ in range(5)]
    _wait_waiting(gate, 5)
    threads.append(_start(gate, "victim", order))  # arrives last
    _wait_waiting(gate, 6)
    gate.release("flood")
    deadline = time.monotonic() + 5
    while not order:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert order == ["victim"]  # it jumped the five queued flood requests
    for _ in range(6):
        gate.release(order[-1] if order else "flood")
    for t in threads:
        t.join(timeout=5)


def test_share_weight_splits_the_slots_of_a_contended_gate():
    gate = FairGate(1)
    gate.acquire("filler")
    order: list[str] = []
    threads = []
    for _ in range(8):  # both queue more than they will get
        threads.append(_start(gate, "heavy", order, 3))
        threads.append(_start(gate, "light", order, 1))
    _wait_waiting(gate, 16)
    gate.release("filler")
    for _ in range(8):  # eight admissions, one at a time
        deadline = time.monotonic() + 5
        n = len(order)
        while len(order) == n:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        gate.release(order[-1])
    first8 = order[:8]
    assert first8.count("heavy") == 6 and first8.count("light") == 2  # 3:1, as weighted
    while len(order) < 16:
        deadline = time.monotonic() + 5
        n = len(order)
        while len(order) == n:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        gate.release(order[-1])
    for t in threads:
        t.join(timeout=5)


def test_a_tenant_back_from_idle_neither_lost_its_turn_nor_banked_credit():
    gate = FairGate(1)
    for _ in range(20):  # a long run alone: its virtual time moves far ahead
        gate.acquire("busy")
        gate.release("busy")
    gate.acquire("busy")
    order: list[str] = []
    threads = [_start(gate, "busy", order) for _ in range(3)]
    _wait_waiting(gate, 3)
    threads.append(_start(gate, "newcomer", order))
    _wait_waiting(gate, 4)
    for _ in range(4):
        gate.release(order[-1] if order else "busy")
        deadline = time.monotonic() + 5
        n = len(order)
        while len(order) == n and len(order) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    assert order[0] == "newcomer" and order[1:3] == ["busy", "busy"]  # first, then its share: no banked run
    for t in threads:
        t.join(timeout=5)


def test_a_cancelled_waiter_leaves_the_queue_without_a_slot():
    gate = FairGate(1)
    gate.acquire("a")
    stop = threading.Event()
    order: list[str] = []
    t = _start(gate, "b", order, stop=stop.is_set)
    _wait_waiting(gate, 1)
    stop.set()
    t.join(timeout=5)
    assert order == [] and gate.waiting() == 0 and gate.running == 1


def test_timeout_raises_and_capacity_must_be_positive():
    gate = FairGate(1)
    gate.acquire("a")
    with pytest.raises(TimeoutError):
        gate.acquire("b", timeout=0.1)
    assert gate.waiting() == 0
    with pytest.raises(ValueError):
        FairGate(0)
