"""Turns between tenants: the fair queue hands chunks out by tokens served, not to whoever came first
(it replaces ``FairTurns``: the scheduler's loop is now the only one running the model)."""

from __future__ import annotations

import pytest

from cachecore.scheduler.queue import FairQueue


def _next(fair: FairQueue, backlogged: list[str]) -> str:
    return min(backlogged, key=lambda o: (fair.vtime(o), o))


def test_a_light_tenant_goes_next_even_behind_a_heavy_tenants_queue():
    fair = FairQueue()
    fair.activate("heavy")
    for _ in range(4):  # heavy was served four chunks before light arrived
        fair.grant("heavy")
        fair.charge("heavy", 256)
    fair.activate("light")
    assert _next(fair, ["heavy", "light"]) == "light"
    fair.grant("light")
    fair.charge("light", 128)
    assert _next(fair, ["heavy", "light"]) == "light"
    fair.charge("light", 256)  # it started at "now", not at zero: no credit for the time it was idle
    assert _next(fair, ["heavy", "light"]) == "heavy"


def test_an_idle_tenant_cannot_bank_credit():
    fair = FairQueue()
    fair.activate("a")
    fair.grant("a")
    fair.charge("a", 1000)
    fair.grant("a")
    fair.activate("b")  # b was idle all along: it starts at a's current virtual time, not 0
    assert fair.vtime("b") == fair.vtime("a")


def test_weights_split_service_in_proportion():
    fair = FairQueue()
    fair.set_weight("big", 3)
    served = {"big": 0, "small": 0}
    for owner in served:
        fair.activate(owner)
    for _ in range(400):
        owner = _next(fair, list(served))
        fair.grant(owner)
        fair.charge(owner, 10)
        served[owner] += 10
    assert served["big"] == pytest.approx(3 * served["small"], rel=0.05)
    assert served["small"] > 0


def test_weights_must_be_positive():
    with pytest.raises(ValueError):
        FairQueue().set_weight("a", 0)
    with pytest.raises(ValueError):
        FairQueue().set_weight("a", True)
    FairQueue().set_weight("a", 0.5)


def test_a_returning_tenant_banks_at_most_one_quantum():
    fair = FairQueue(quantum=100)
    fair.activate("a")
    for _ in range(5):
        fair.grant("a")
        fair.charge("a", 1000)
    fair.grant("a")
    fair.activate("b")
    assert fair.vtime("b") == fair.vtime("a") - 100  # one quantum ahead, not 5,000 tokens
    fair.set_weight("c", 4)
    fair.activate("c")
    assert fair.vtime("c") == fair.vtime("a") - 25  # a quantum in its own (weighted) tokens
    with pytest.raises(ValueError):
        FairQueue(quantum=-1)
