"""cachecore.routing.inflight: prefixes dispatched to a replica and not yet cached, kept while in its queue."""

from __future__ import annotations

from cachecore.routing.inflight import InFlight


def test_match_is_the_longest_prefix_held_by_the_replica_s_in_flight_requests():
    inflight = InFlight()
    inflight.add("r0", ("a", "b", "c"))
    assert inflight.match("r0", ("a", "b", "x", "c")) == 2
    assert inflight.match("r0", ("x", "a")) == 0  # a prefix, not any block
    assert inflight.match("r1", ("a", "b")) == 0  # only where it was sent
    assert inflight.requests("r0") == 1 and inflight.requests("r1") == 0


def test_trim_keeps_the_newest_dispatches_as_many_as_the_replica_still_queues():
    inflight = InFlight()
    inflight.add("r0", ("a", "b"))
    inflight.add("r0", ("a", "c"))  # shares "a" with the first
    inflight.trim("r0", 2)
    assert inflight.requests("r0") == 2
    inflight.trim("r0", 1)  # the older one was prefilled: its own block goes, the shared one stays
    assert inflight.match("r0", ("a", "b")) == 1 and inflight.match("r0", ("a", "c")) == 2
    inflight.trim("r0", 0)
    assert inflight.match("r0", ("a",)) == 0 and inflight.requests("r0") == 0
    inflight.trim("r9", 0)  # an unknown replica: nothing to do


def test_forget_drops_a_replica():
    inflight = InFlight()
    inflight.add("r0", ("a",))
    inflight.add("r1", ("a",))
    inflight.forget("r0")
    assert inflight.match("r0", ("a",)) == 0 and inflight.match("r1", ("a",)) == 1
