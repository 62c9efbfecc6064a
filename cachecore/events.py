"""KV events: what a replica's cache tiers stored and removed, published for routers to index.

A replica publishes **batches** of typed events, each batch with the replica's id and a sequence
number that grows by exactly one per batch (``1, 2, 3, ...``), so a consumer sees a gap when it
missed one. Events carry chain hashes only (``cachecore.hashing``), never token ids, tenant ids or
bytes: the hash chain already binds the tenant's scope salt, so a hash matches only requests of the
same scope. The JSON form (``to_dict`` / ``from_dict``) is documented in ``docs/kv-events.md``.

- :class:`BlockStored` ``(tier, hashes)``: the tier now holds these blocks (prefix order).
- :class:`BlockRemoved` ``(tier, hashes, reason)``: it no longer does; ``reason`` is one of
  ``REMOVAL_REASONS``.
- :class:`AllCleared` ``(tier)``: the tier (``None``: every tier) holds nothing any more.

:class:`EventLog` is the replica's side: a bounded ring buffer of batches that a router reads with
``since(seq)`` (a consumer that fell behind the buffer gets ``gap=True`` and reconciles from
``snapshot()``), and a mirror of what every tier holds according to the events so far, so the
snapshot is exactly the state after its ``seq``. The tiers publish into it through
:mod:`cachecore.event_recorders` (one batch per store operation).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from cachecore.hashing import HASH_BYTES

__all__ = [
    "REMOVAL_REASONS", "TIERS", "AllCleared", "BlockRemoved", "BlockStored", "Event", "EventBatch", "EventLog",
    "InvalidEvent", "event_from_dict",
]

TIERS = ("l1", "l2", "l3")
#: Why a tier removed blocks: reused for other blocks, dropped by a flush (tenant, model, revision,
#: rollout, shred), over the owner's cap, failed its integrity check, past its retention, or (L3)
#: left the bounded set of chunks this replica vouches for (the object may still exist).
REMOVAL_REASONS = ("evicted", "flushed", "capped", "corrupt", "expired", "untracked")

DEFAULT_CAPACITY = 4096  # batches kept for consumers that poll
DEFAULT_SINCE_LIMIT = 512  # batches one ``since`` call returns at most


class InvalidEvent(ValueError):
    """An event, batch or snapshot in its dict form is malformed (wrong type, tier, reason or hash)."""


def _hashes_out(hashes: Sequence[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def _hashes_in(raw: object, what: str) -> tuple[bytes, ...]:
    if not isinstance(raw, list | tuple):
        raise InvalidEvent(f"{what}: hashes must be a list of hex strings")
    out = []
    for h in raw:
        try:
            b = bytes.fromhex(h)
        except (TypeError, ValueError):
            raise InvalidEvent(f"{what}: hash {h!r} is not hex") from None
        if len(b) != HASH_BYTES:
            raise InvalidEvent(f"{what}: a hash must be {HASH_BYTES} bytes, got {len(b)}")
        out.append(b)
    return tuple(out)


def _tier_in(raw: object, what: str, *, optional: bool = False) -> str | None:
    if raw is None and optional:
        return None
    if raw not in TIERS:
        raise InvalidEvent(f"{what}: tier must be one of {TIERS}, got {raw!r}")
    return raw


@dataclass(frozen=True, slots=True)
class BlockStored:
    tier: str
    hashes: tuple[bytes, ...]

    def to_dict(self) -> dict:
        return {"type": "stored", "tier": self.tier, "hashes": _hashes_out(self.hashes)}


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    tier: str
    hashes: tuple[bytes, ...]
    reason: str

    def to_dict(self) -> dict:
        return {"type": "removed", "tier": self.tier, "hashes": _hashes_out(self.hashes), "reason": self.reason}


@dataclass(frozen=True, slots=True)
class AllCleared:
    tier: str | None  # None: every tier

    def to_dict(self) -> dict:
        return {"type": "cleared", "tier": self.tier}


Event = BlockStored | BlockRemoved | AllCleared


def event_from_dict(d: object) -> Event:
    """The event of ``to_dict``'s form. Raises ``InvalidEvent`` for anything else."""
    if not isinstance(d, dict):
        raise InvalidEvent("an event must be an object")
    kind = d.get("type")
    if kind == "stored":
        return BlockStored(_tier_in(d.get("tier"), "stored"), _hashes_in(d.get("hashes"), "stored"))
    if kind == "removed":
        reason = d.get("reason")
        if reason not in REMOVAL_REASONS:
            raise InvalidEvent(f"removed: reason must be one of {REMOVAL_REASONS}, got {reason!r}")
        return BlockRemoved(_tier_in(d.get("tier"), "removed"), _hashes_in(d.get("hashes"), "removed"), reason)
    if kind == "cleared":
        return AllCleared(_tier_in(d.get("tier"), "cleared", optional=True))
    raise InvalidEvent(f"unknown event type {kind!r}")


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one store operation, in order. ``seq`` is 1 for a replica's first batch and grows
    by one per batch; ``ts`` is the replica's wall clock (seconds since the epoch) at publication."""

    replica_id: str
    seq: int
    ts: float
    events: tuple[Event, ...]

    def to_dict(self) -> dict:
        return {"replica_id": self.replica_id, "seq": self.seq, "ts": self.ts,
                "events": [e.to_dict() for e in self.events]}

    @classmethod
    def from_dict(cls, d: object) -> EventBatch:
        """The batch of ``to_dict``'s form. Raises ``InvalidEvent`` for anything else."""
        if not isinstance(d, dict):
            raise InvalidEvent("a batch must be an object")
        rid, seq, ts, events = d.get("replica_id"), d.get("seq"), d.get("ts"), d.get("events")
        if not isinstance(rid, str) or not rid:
            raise InvalidEvent("batch: replica_id must be a non-empty string")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise InvalidEvent(f"batch: seq must be an int >= 1, got {seq!r}")
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise InvalidEvent(f"batch: ts must be a number, got {ts!r}")
        if not isinstance(events, list | tuple):
            raise InvalidEvent("batch: events must be a list")
        return cls(rid, seq, float(ts), tuple(event_from_dict(e) for e in events))


def _check_seq(seq: object) -> int:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"seq must be an int >= 0, got {seq!r}")
    return seq


class EventLog:
    """The replica's KV event log: a thread-safe ring buffer of the last ``capacity`` batches and a
    mirror of every tier's hashes as the events so far leave them.

    ``publish`` holds the log's lock for a sequence increment, a deque append and one set update per
    event (C loops over the hashes); callers may hold their own store lock around it (the log's lock
    is always the innermost one).
    """

    def __init__(self, replica_id: str, *, capacity: int = DEFAULT_CAPACITY,
                 clock=time.time) -> None:
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError("replica_id must be a non-empty string")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.replica_id = replica_id
        self.capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._buf: deque[EventBatch] = deque(maxlen=capacity)
        self._state: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self.counts = {"batches": 0, "events": 0, "hashes": 0}

    @property
    def seq(self) -> int:
        """The seq of the last batch published (0 before the first)."""
        return self._seq

    def publish(self, *events: Event) -> int | None:
        """Publish ``events`` as one batch; returns its seq, or None (nothing published) when every
        event is empty. Events with no hashes are left out."""
        kept = tuple([e for e in events if type(e) is AllCleared or e.hashes])  # a list is built faster
        if not kept:
            return None
        ts = self._clock()
        with self._lock:
            state = self._state
            n = 0
            for e in kept:
                if type(e) is BlockStored:
                    state[e.tier].update(e.hashes)
                    n += len(e.hashes)
                elif type(e) is BlockRemoved:
                    state[e.tier].difference_update(e.hashes)
                    n += len(e.hashes)
                else:
                    for tier in TIERS if e.tier is None else (e.tier,):
                        state[tier].clear()
            self._seq += 1
            self._buf.append(EventBatch(self.replica_id, self._seq, ts, kept))
            counts = self.counts
            counts["batches"] += 1
            counts["events"] += len(kept)
            counts["hashes"] += n
            return self._seq

    def since(self, seq: int, limit: int = DEFAULT_SINCE_LIMIT) -> tuple[list[EventBatch], bool]:
        """``(batches, gap)``: up to ``limit`` batches with a seq greater than ``seq``, oldest first.
        ``gap`` is True (and no batches come back) when the buffer no longer holds batch ``seq + 1``
        or ``seq`` is one this log never issued: the consumer must reconcile from ``snapshot()`` and
        continue from its ``seq``. Raises ``ValueError`` for a negative or non-int ``seq``/``limit``."""
        _check_seq(seq)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        with self._lock:
            last = self._seq
            if seq >= last:
                return [], seq > last
            oldest = self._buf[0].seq
            if seq + 1 < oldest:
                return [], True
            start = seq + 1 - oldest
            return list(itertools.islice(self._buf, start, start + limit)), False

    def page(self, since_seq: int) -> dict:
        """Plain data of the batches from ``since_seq`` on (inclusive: the next seq the consumer
        expects; 1 for everything still buffered): ``{"replica_id", "seq" (the last published),
        "gap", "batches": [EventBatch.to_dict()...]}``. ``gap`` True (no batches) means batch
        ``since_seq`` is no longer buffered: reconcile from ``snapshot()``. Raises ``ValueError`` for
        a ``since_seq`` that is not an int >= 1."""
        if isinstance(since_seq, bool) or not isinstance(since_seq, int) or since_seq < 1:
            raise ValueError(f"since_seq must be an int >= 1, got {since_seq!r}")
        batches, gap = self.since(since_seq - 1)
        return {"replica_id": self.replica_id, "seq": self.seq, "gap": gap, "batches": [b.to_dict() for b in batches]}

    def snapshot(self) -> dict:
        """``{"replica_id", "seq", "tiers": {tier: [hex hashes]}}``: what every tier holds after the
        batches up to ``seq``, by the events (hash order is arbitrary)."""
        with self._lock:
            seq = self._seq
            copies = {t: list(s) for t, s in self._state.items()}
        return {"replica_id": self.replica_id, "seq": seq,
                "tiers": {t: _hashes_out(hs) for t, hs in copies.items()}}

    def stats(self) -> dict:
        with self._lock:
            return {"replica_id": self.replica_id, "seq": self._seq, "capacity": self.capacity,
                    "buffered": len(self._buf), "oldest_seq": self._buf[0].seq if self._buf else None,
                    "held": {t: len(s) for t, s in self._state.items()}, **self.counts}
