"""``common.limit_store.ExpiringOnlyCache``: the embedded store of limit and lockout state never drops a
live entry; and ``common.throttle`` treats a source it cannot track in a full store as locked, while
sources it already tracks keep their normal lockouts."""

from __future__ import annotations

import uuid

import pytest

from controlplane.common.limit_store import ExpiringOnlyCache, LimitStoreFull


@pytest.fixture
def store(clock):
    return ExpiringOnlyCache(f"limit-store-{uuid.uuid4().hex}", {"TIMEOUT": None, "OPTIONS": {"MAX_ENTRIES": 3}})


def test_a_full_store_keeps_every_live_entry_and_refuses_a_new_key(store, clock):
    for name in ("a", "b", "c"):
        store.set(name, 1, timeout=60)
    with pytest.raises(LimitStoreFull) as refused:
        store.add("d", 1, timeout=60)
    assert refused.value.retry_after == 60
    assert [store.get(name) for name in ("a", "b", "c")] == [1, 1, 1]  # nothing was culled
    assert store.incr("a") == 2 and store.set("b", 5, timeout=60) is None  # existing keys still change
    assert store.full_for() == 60


def test_a_full_store_drops_expired_entries_only_to_make_room(store, clock):
    store.set("old", 1, timeout=10)
    store.set("live", 1, timeout=600)
    store.set("live2", 1, timeout=600)
    clock.advance(11)
    assert store.add("new", 1, timeout=600) is True
    assert store.get("old") is None and store.get("live") == 1 and store.get("live2") == 1
    assert store.full_for() == 589  # room again once the soonest live entry expires


def test_an_untracked_source_is_locked_while_the_lockout_store_is_full(clock, settings):
    from controlplane.common import throttle

    settings.CACHES = {**settings.CACHES, "lockouts": {**settings.CACHES["lockouts"], "OPTIONS": {"MAX_ENTRIES": 4}}}
    failure = {"scope": "t", "limit": 3, "window_s": 60, "lockout_s": 60}
    throttle.throttle_failure(key="tracked", **failure)  # its count and its lock slot: 2 entries
    throttle.throttle_failure(key="filler", **failure)   # 2 more: the store is full
    assert throttle.throttle_retry_after(scope="t", key="newcomer") == 60  # untracked: locked, not free
    throttle.throttle_failure(key="newcomer", **failure)  # cannot be counted...
    assert throttle.throttle_retry_after(scope="t", key="newcomer") == 60  # ...and stays locked
    assert throttle.throttle_retry_after(scope="t", key="tracked") is None  # tracked keys work as before
    throttle.throttle_failure(key="tracked", **failure)
    assert throttle.throttle_failure(key="tracked", **failure) == 60  # its third failure locks it
    assert throttle.throttle_retry_after(scope="t", key="tracked") == 60
    clock.advance(61)
    assert throttle.throttle_retry_after(scope="t", key="newcomer") is None  # expired entries made room
