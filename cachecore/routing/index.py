"""The router's weakly consistent index of which replica probably holds which block hashes.

It is fed by the replicas' KV events (:mod:`cachecore.events`) and holds chain hashes only, never
token ids or tenant data. Scoping comes for free: a block's hash binds the tenant's scope salt, so a
request's hashes (``cachecore.routing.hashes.request_hashes``) only ever equal blocks of its own
scope.

Tolerance, per replica:

- **duplicates and reordering**: a batch whose ``seq`` was already applied is ignored (and a block
  stored twice is stored once);
- **loss**: a batch that is not the next one (``seq`` skips ahead) is not applied and ``apply``
  returns False; the caller then ``reconcile``s from the replica's snapshot, which replaces that
  replica's state and its sequence number;
- **staleness**: the replica re-checks every hit it serves; ``correct`` drops the blocks it claimed
  and did not serve, unless a later event stored them again.

Memory is bounded per replica (``max_blocks_per_replica``): past it the least recently stored
blocks are forgotten (a forgotten block only costs a missed affinity, never a wrong answer).
Thread-safe (one lock; ``match`` is O(replicas x matched blocks)).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from cachecore.events import TIERS, AllCleared, BlockRemoved, BlockStored, EventBatch, InvalidEvent

__all__ = ["DEFAULT_MAX_BLOCKS", "PrefixIndex"]

DEFAULT_MAX_BLOCKS = 1 << 18  # per replica (about 50 MB of index at most)
_MATCH_MEMORY = 1 << 16  # recent (replica, request) matches remembered for ``correct`` (all replicas)
_BIT = {t: 1 << i for i, t in enumerate(TIERS)}
_ALL = (1 << len(TIERS)) - 1
_SHIFT = len(TIERS)  # an entry is (seq it was last stored at) << _SHIFT | tier bits


class _Replica:
    __slots__ = ("applied", "blocks")

    def __init__(self) -> None:
        self.applied = 0  # seq of the last batch applied (or of the snapshot reconciled)
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # least recently stored first


class PrefixIndex:
    """replica_id -> per-tier sets of block hashes (module docstring)."""

    def __init__(self, *, max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS) -> None:
        if isinstance(max_blocks_per_replica, bool) or not isinstance(max_blocks_per_replica, int) \
                or max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be an int >= 1, got {max_blocks_per_replica!r}")
        self.max_blocks = max_blocks_per_replica
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        self._block_size: int | None = None
        # (replica_id, last hash of a matched request) -> the replica's applied seq when it matched.
        self._matched: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self.counts = {"applied": 0, "ignored": 0, "gaps": 0, "reconciled": 0, "corrected_blocks": 0,
                       "forgotten_blocks": 0}

    # ------------------------------------------------------------------ feeding
    def apply(self, batch: EventBatch) -> bool:
        """Apply ``batch`` if it is the replica's next one; ignore it (True) if its seq was already
        applied; return False, applying nothing, if it skips ahead (a lost batch: reconcile)."""
        with self._lock:
            rep = self._replicas.get(batch.replica_id)
            if rep is None:
                rep = self._replicas[batch.replica_id] = _Replica()
            if batch.seq <= rep.applied:
                self.counts["ignored"] += 1
                return True
            if batch.seq != rep.applied + 1:
                self.counts["gaps"] += 1
                return False
            for event in batch.events:
                self._apply_event(rep, event, batch.seq)
            rep.applied = batch.seq
            self.counts["applied"] += 1
            return True

    def _apply_event(self, rep: _Replica, event, seq: int) -> None:
        blocks = rep.blocks
        if isinstance(event, BlockStored):
            bit, stamp = _BIT[event.tier], seq << _SHIFT
            for h in event.hashes:
                old = blocks.pop(h, 0)
                blocks[h] = stamp | (old & _ALL) | bit
            self._trim(rep)
        elif isinstance(event, BlockRemoved):
            keep = ~_BIT[event.tier]
            for h in event.hashes:
                old = blocks.get(h)
                if old is None:
                    continue
                if old & _ALL & keep:
                    blocks[h] = old & keep
                else:
                    del blocks[h]
        elif isinstance(event, AllCleared):
            if event.tier is None:
                blocks.clear()
            else:
                keep = ~_BIT[event.tier]
                for h in list(blocks):
                    v = blocks[h] & keep
                    if v & _ALL:
                        blocks[h] = v
                    else:
                        del blocks[h]
        else:
            raise InvalidEvent(f"unknown event {event!r}")

    def _trim(self, rep: _Replica) -> None:
        over = len(rep.blocks) - self.max_blocks
        if over > 0:
            for _ in range(over):
                rep.blocks.popitem(last=False)
            self.counts["forgotten_blocks"] += over

    def reconcile(self, snapshot: Mapping) -> None:
        """Replace a replica's state with its ``EventLog.snapshot()`` (``{"replica_id", "seq",
        "tiers": {tier: [hex hashes]}}``); batches up to its ``seq`` are then ignored. Raises
        ``InvalidEvent`` for a malformed snapshot (changing nothing)."""
        if not isinstance(snapshot, Mapping):
            raise InvalidEvent("a snapshot must be an object")
        rid, seq, tiers = snapshot.get("replica_id"), snapshot.get("seq"), snapshot.get("tiers")
        if not isinstance(rid, str) or not rid:
            raise InvalidEvent("snapshot: replica_id must be a non-empty string")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise InvalidEvent(f"snapshot: seq must be an int >= 0, got {seq!r}")
        if not isinstance(tiers, Mapping) or set(tiers) - set(TIERS):
            raise InvalidEvent(f"snapshot: tiers must map tiers of {TIERS} to lists of hashes")
        rep = _Replica()
        stamp = seq << _SHIFT
        for tier, hashes in tiers.items():
            bit = _BIT[tier]
            if not isinstance(hashes, list | tuple):
                raise InvalidEvent(f"snapshot: tier {tier} must hold a list of hex hashes")
            try:
                for h in hashes:
                    key = bytes.fromhex(h)
                    rep.blocks[key] = stamp | (rep.blocks.get(key, 0) & _ALL) | bit
            except (TypeError, ValueError):
                raise InvalidEvent(f"snapshot: tier {tier} holds a hash that is not hex") from None
        rep.applied = seq
        self._trim(rep)
        with self._lock:
            self._replicas[rid] = rep
            self.counts["reconciled"] += 1

    def drop_replica(self, replica_id: str) -> None:
        """Forget ``replica_id`` (it died or left); its events start from a snapshot again."""
        with self._lock:
            self._replicas.pop(replica_id, None)

    def expected_seq(self, replica_id: str) -> int:
        """The seq of the next batch ``apply`` takes from ``replica_id`` (1 for an unknown replica)."""
        with self._lock:
            rep = self._replicas.get(replica_id)
            return 1 if rep is None else rep.applied + 1

    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    # ------------------------------------------------------------------ routing
    def match(self, hashes: Sequence[bytes], block_size: int) -> dict[str, dict[str, int]]:
        """replica_id -> ``Hit`` (``cachecore.routing.cost``) in tokens for a request's block
        ``hashes``, walking tiers the way the engine does: the L1 prefix, then the L2 blocks right
        after it, then the L3 blocks after those; each value is cumulative (``{"l1": 32, "l2": 32,
        "l3": 96}``: [0, 32) in L1, nothing in L2, [32, 96) in L3). Replicas with no hit are left
        out. ``hashes`` are all the request's full blocks; the engine never serves the last prompt
        token from cache, which the caller's cost model accounts for by prompt length."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        out: dict[str, dict[str, int]] = {}
        n = len(hashes)
        with self._lock:
            self._block_size = block_size
            for rid, rep in self._replicas.items():
                blocks = rep.blocks
                i, hit = 0, {}
                for tier in TIERS:
                    bit = _BIT[tier]
                    while i < n:
                        v = blocks.get(hashes[i])
                        if v is None or not v & bit:
                            break
                        i += 1
                    hit[tier] = i * block_size
                if i:
                    out[rid] = hit
                    self._remember_match(rid, hashes[-1], rep.applied)
        return out

    def _remember_match(self, rid: str, last: bytes, seq: int) -> None:
        key = (rid, last)
        self._matched[key] = seq
        self._matched.move_to_end(key)
        if len(self._matched) > _MATCH_MEMORY:
            self._matched.popitem(last=False)

    def correct(self, replica_id: str, hashes: Sequence[bytes], served_tokens: int, *,
                block_size: int | None = None) -> int:
        """The replica served only ``served_tokens`` of a request's ``hashes`` from cache (it
        re-checked them): drop the blocks after that which the index held when it last matched this
        request for the replica, unless an event stored them again since (the request's own commit,
        typically). The last block is kept (the engine never serves the last prompt token, so it
        proves nothing). ``block_size`` defaults to the last one ``match`` was given. Returns the
        blocks dropped; 0 when the request was never matched for the replica (nothing to trust)."""
        bs = block_size if block_size is not None else self._block_size
        if bs is None or isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise ValueError("correct needs the block size (pass block_size or match first)")
        if isinstance(served_tokens, bool) or not isinstance(served_tokens, int) or served_tokens < 0:
            raise ValueError(f"served_tokens must be an int >= 0, got {served_tokens!r}")
        if not hashes:
            return 0
        dropped = 0
        with self._lock:
            as_of = self._matched.pop((replica_id, hashes[-1]), None)
            rep = self._replicas.get(replica_id)
            if as_of is None or rep is None:
                return 0
            for h in hashes[served_tokens // bs : len(hashes) - 1]:
                v = rep.blocks.get(h)
                if v is not None and v >> _SHIFT <= as_of:
                    del rep.blocks[h]
                    dropped += 1
            self.counts["corrected_blocks"] += dropped
        return dropped

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        with self._lock:
            per = {rid: {"applied_seq": rep.applied,
                         **{t: sum(1 for v in rep.blocks.values() if v & _BIT[t]) for t in TIERS}}
                   for rid, rep in self._replicas.items()}
            return {"replicas": per, **self.counts}

    def held(self, replica_id: str) -> dict[str, set[bytes]]:
        """Every tier's hashes the index believes ``replica_id`` holds (tests, debugging)."""
        with self._lock:
            rep = self._replicas.get(replica_id)
            items = list(rep.blocks.items()) if rep is not None else []
        return {t: {h for h, v in items if v & _BIT[t]} for t in TIERS}

    def holds(self, replica_id: str, block_hash: bytes) -> tuple[str, ...]:
        """The tiers the index believes ``replica_id`` holds ``block_hash`` in (tests, debugging)."""
        with self._lock:
            rep = self._replicas.get(replica_id)
            v = rep.blocks.get(block_hash, 0) if rep is not None else 0
            return tuple(t for t in TIERS if v & _BIT[t])
