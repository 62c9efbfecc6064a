"""The generic circuit breaker (cachecore/tiers/remote/breaker.py): closed -> open after N consecutive
failures, refusing calls for the cooldown, then half-open (calls allowed), closed by a success or
opened again by a failure; thread-safe. A fake clock drives time; nothing sleeps."""

from __future__ import annotations

import threading

import pytest

from cachecore.tiers.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breaker(threshold: int = 3, cooldown: float = 10.0) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(failure_threshold=threshold, cooldown_seconds=cooldown, clock=clock), clock


def test_opens_after_n_consecutive_failures_and_a_success_starts_the_count_again():
    b, _ = _breaker(threshold=3)
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED and b.allow() and b.failures == 2
    b.record_success()  # not consecutive any more
    assert b.failures == 0
    b.record_failure()
    b.record_failure()
    assert b.allow()
    b.record_failure()
    assert b.state == OPEN and not b.allow() and b.opened == 1


def test_open_refuses_for_the_cooldown_then_half_open_allows_every_caller():
    b, clock = _breaker(threshold=1, cooldown=10.0)
    b.record_failure()
    assert not b.allow()
    clock.now += 9.999
    assert not b.allow() and b.state == OPEN
    clock.now += 0.001  # exactly the cooldown
    assert b.state == HALF_OPEN
    assert b.allow() and b.allow()  # no trial quota: every caller goes through


def test_half_open_closes_on_success_and_reopens_on_one_failure():
    b, clock = _breaker(threshold=3, cooldown=5.0)
    for _ in range(3):
        b.record_failure()
    clock.now += 5
    assert b.state == HALF_OPEN
    b.record_success()
    assert b.state == CLOSED and b.failures == 0
    for _ in range(3):
        b.record_failure()
    clock.now += 5
    assert b.state == HALF_OPEN
    b.record_failure()  # one failure while half-open is enough, whatever the threshold
    assert b.state == OPEN and not b.allow() and b.opened == 3
    clock.now += 5
    assert b.allow()


def test_a_failure_while_open_rearms_the_cooldown_and_a_success_while_open_is_ignored():
    b, clock = _breaker(threshold=1, cooldown=10.0)
    b.record_failure()
    clock.now += 8
    b.record_failure()  # a call that started before the breaker opened
    clock.now += 8
    assert not b.allow()
    b.record_success()  # likewise: says nothing of now
    assert b.state == OPEN
    clock.now += 2
    assert b.allow() and b.opened == 1


def test_cooldown_is_settable_and_reset_closes():
    b, clock = _breaker(threshold=1, cooldown=10.0)
    b.cooldown_seconds = 1.0
    b.record_failure()
    clock.now += 1
    assert b.allow()
    b.record_failure()
    b.reset()
    assert b.state == CLOSED and b.allow()


@pytest.mark.parametrize("kwargs", [{"failure_threshold": 0}, {"failure_threshold": True}, {"failure_threshold": 1.5},
                                    {"cooldown_seconds": -1}, {"cooldown_seconds": float("nan")}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)


def test_concurrent_failures_are_all_counted_and_open_it_once():
    b, _ = _breaker(threshold=8 * 500 + 1)
    threads = [threading.Thread(target=lambda: [b.record_failure() for _ in range(500)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.failures == 4000 and b.state == CLOSED
    b.record_failure()
    assert b.state == OPEN and b.opened == 1


def test_concurrent_callers_never_see_a_torn_state():
    b, clock = _breaker(threshold=3, cooldown=1.0)
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        try:
            while not stop.is_set():
                if b.allow():
                    b.record_success()
                b.record_failure()
                b.record_failure()
                # closed: fewer than the threshold counted; open / half-open: none
                assert b.failures < b.failure_threshold
                assert b.state in (CLOSED, OPEN, HALF_OPEN)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(200):
        clock.now += 0.5
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    b.reset()
    assert b.state == CLOSED and b.failures == 0 and b.allow()
