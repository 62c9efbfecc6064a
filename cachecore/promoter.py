"""Promoter: a request's lower-tier prefix, read from L2 and L3 into its fresh L1 pages.

At admission, under the engine's lock, ``plan`` finds the L2 prefix after the L1 hit and decides
load or recompute (:mod:`cachecore.loadcost`); ``start`` begins the load on a loader thread at once
(prefetch: it overlaps the request's wait for its model turn), adding the L3 chunks after the L2
prefix when L3 may hold them. ``finish`` waits for it up to the load deadline, copies what arrived
into the request's pages, registers those blocks in L1 (unless the fence says the request is stale)
and promotes the chunks that came from L3 into L2 too. L3 is probed, decided (with its own measured
bandwidth) and fetched on the loader thread, never under the lock. A block that did not arrive,
arrived late or failed its check is a miss for it and every block after it (recomputed).

Collaborators: the engine's lock, L1 (``DeviceStore``), L2 and L3 (each may be None), the load-cost
model, the metrics, the flush fence and the load deadline.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, NamedTuple

import torch

from cachecore.sequence import CachedSequence

if TYPE_CHECKING:
    from cachecore.flush_fence import FlushFence
    from cachecore.loadcost import LoadCost
    from cachecore.metrics import CacheMetrics
    from cachecore.tiers.device import DeviceStore
    from cachecore.tiers.host import HostStore
    from cachecore.tiers.remote import RemoteStore


class Plan(NamedTuple):
    """The L2 part of an admission. ``items``: the (key, tokens) to load; ``found``: how many L2 held
    within the request's room, before the cost decision; ``lookup``: how many it held after the L1
    hit at all (the metadata hit); ``stop``: ``"recompute"`` when the cost model declined them."""

    items: list[tuple[bytes, tuple]]
    found: int
    lookup: int
    stop: str | None


class Promoter:
    def __init__(self, *, lock: threading.RLock, l1: DeviceStore, l2: HostStore | None, l3: RemoteStore | None,
                 cost: LoadCost, metrics: CacheMetrics, fence: FlushFence, deadline_s: float) -> None:
        self._lock = lock
        self._l1, self._l2, self._l3 = l1, l2, l3
        self._cost = cost
        self._metrics = metrics
        self._fence = fence
        self._deadline_s = deadline_s
        self._bs, self._bpb = l1.layout.block_size, l1.layout.bytes_per_block
        lower = l2 is not None or l3 is not None
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="strata-load") if lower else None

    # ------------------------------------------------------------------ admission (under the lock)
    def plan(self, hashes: list[bytes], tokens: list[int], start: int, room: int) -> Plan:
        """The L2 prefix from block ``start`` (the end of the L1 hit). ``room``: blocks it may cover
        before the last-token rule stops it (negative: the L1 hit already went past that, and L2 is
        not asked)."""
        items = self._l2_prefix(hashes, tokens, start) if room >= 0 else []
        lookup = len(items)
        items = items[: max(0, room)]
        found, stop = len(items), None
        if items and not self._cost.should_load("l2", nbytes=len(items) * self._bpb, tokens=len(items) * self._bs):
            self._metrics.tier("l2").fallbacks_to_recompute += 1
            items, stop = [], "recompute"
        return Plan(items, found, lookup, stop)

    def _l2_prefix(self, hashes: list[bytes], tokens: list[int], start: int) -> list[tuple[bytes, tuple]]:
        if self._l2 is None:
            return []
        bs = self._bs
        items = []
        for i in range(start, len(hashes)):
            item = (hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            if not self._l2.contains(*item):
                break
            items.append(item)
        return items

    def start(self, seq: CachedSequence, fresh: list, plan: Plan, start: int, limit: int) -> None:
        """Begin loading ``plan``'s L2 items, then any L3 chunks after them up to block ``limit``, into
        ``fresh`` (the request's blocks from ``start``); with nothing to load, the query is final and
        counted now."""
        seq.load_stop = plan.stop
        # L3 may hold chunks after the L1+L2 prefix (unless L2 already stops short of it). A request
        # that may not persist (the tenant turned persistence off, or "in_memory") never reads L3
        # either: what a tenant withdrew from L3 must stop being served at once.
        covered = start + len(plan.items)
        l3 = self._l3
        try_l3 = (l3 is not None and seq.use_cache and seq.tag.persist and covered < limit
                  and (covered // l3.chunk_blocks + 1) * l3.chunk_blocks <= len(seq.hashes)
                  and len(plan.items) == plan.found)
        if plan.items or try_l3:
            seq.load_blocks = fresh[: (limit - start) if try_l3 else len(plan.items)]
            seq.load_started = time.perf_counter()
            seq.pending = self._loader.submit(self._load, seq, plan.items, start, limit, try_l3)
        else:
            self.record(seq)

    def record(self, seq: CachedSequence) -> None:
        """Count ``seq``'s query (its cached prefix is final). Load success counts bytes that arrived
        in time; bytes that arrive after the deadline are added by ``_late_arrival``. A request admitted
        again (``count_query=False``) was counted at its first admission."""
        if not seq.count_query:
            return
        self._metrics.record_query(
            tenant=seq.tag.owner, model=seq.tag.model, query_tokens=seq.prompt_len,
            lookup_hit_tokens=seq.lookup_hit_tokens, load_success_tokens=seq.num_cached_tokens,
            effective_hit_tokens=seq.num_cached_tokens,
        )

    # ------------------------------------------------------------------ the loader thread
    def _load(self, seq: CachedSequence, l2_items: list, start: int, limit: int, try_l3: bool) -> dict:
        """The lower-tier prefix of ``seq`` from block ``start``: the L2 items, then L3 chunks after
        them (probed, decided and fetched here, off the engine's lock). Returns the KV rows in order
        and what each tier delivered; never raises for a tier's state."""
        bs, bpb = self._bs, self._bpb
        out: dict = {"parts": [], "l2": 0, "l3": 0, "l2_stop": None, "l3_stop": None, "l2_s": 0.0, "l3_s": 0.0,
                     "l3_lookup": 0}
        if l2_items:
            t0 = time.perf_counter()
            fetched = self._l2.get(l2_items)
            out["l2_s"] = time.perf_counter() - t0
            out["l2"], out["l2_stop"] = int(fetched.kv.shape[0]), fetched.stopped
            if out["l2"]:
                out["parts"].append(fetched.kv)
            if out["l2"] < len(l2_items):
                return out
        if not try_l3:
            return out
        covered = start + out["l2"]
        cb = self._l3.chunk_blocks
        c0 = covered // cb * cb
        t0 = time.perf_counter()
        found = self._l3.probe(seq.hashes[c0:], seq.tag)
        end = min(c0 + found, limit)
        out["l3_lookup"] = max(0, c0 + found - covered)
        if end > covered and self._cost.should_load("l3", nbytes=(end - covered) * bpb, tokens=(end - covered) * bs):
            fetched = self._l3.get(seq.hashes, seq.tokens, seq.tag, end, first_block=covered,
                                   retention_seconds=seq.retention_seconds)
            out["l3"], out["l3_stop"] = int(fetched.kv.shape[0]), fetched.stopped
            if out["l3"]:
                out["parts"].append(fetched.kv)
        elif end > covered:
            out["l3_stop"] = "recompute"
        out["l3_s"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ before the forward
    def finish(self, seq: CachedSequence) -> int:
        """Wait (up to the load deadline) for the lower-tier prefix ``start`` began and copy it into
        the request's pages; a block that did not arrive in time, failed or was corrupt is a miss for
        it and every block after it (recomputed). Returns the final ``num_cached_tokens``. Idempotent."""
        future, seq.pending = seq.pending, None
        if future is None:
            return seq.num_cached_tokens
        bs, bpb = self._bs, self._bpb
        waited = self._deadline_s - (time.perf_counter() - seq.load_started)
        result = None
        try:
            result = future.result(timeout=max(0.0, waited))
        except FutureTimeout:  # late: a miss now; counted as load success if its bytes arrive later
            future.add_done_callback(lambda f, seq=seq: self._late_arrival(seq, f))
            seq.load_stop = "late"
        except Exception:  # a store failing outright is a miss too
            result = None
            seq.load_stop = "failed"
        n2 = result["l2"] if result else 0
        n3 = result["l3"] if result else 0
        n = min(n2 + n3, len(seq.load_blocks))
        if result:
            stops = [s for s in (result["l2_stop"], result["l3_stop"]) if s not in (None, "miss")]
            seq.load_stop = stops[0] if stops else None
        seq.tier_tokens["l2"] += min(n2, n) * bs
        seq.tier_tokens["l3"] += (n - min(n2, n)) * bs
        if n:
            kv = torch.cat(result["parts"]) if len(result["parts"]) > 1 else result["parts"][0]
            self._l1.write(seq.load_blocks[:n], kv[:n])
            if n3 and self._l2 is not None:  # chunks loaded from L3 land in L2 too (promotion)
                first = seq.num_registered + n2
                rows = range(first, first + min(n3, n - n2))
                stored = self._l2.put_many(
                    [(seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]), seq.tag) for i in rows],
                    kv[n2 : n2 + len(rows)])
                with self._lock:
                    self._metrics.tier("l2").bytes_in += stored * bpb
        with self._lock:
            for name, got, secs, stop in (("l2", n2, result["l2_s"] if result else 0.0, result and result["l2_stop"]),
                                          ("l3", n3, result["l3_s"] if result else 0.0, result and result["l3_stop"])):
                tier = self._metrics.tier(name)
                if got:
                    self._metrics.observe_load(name, tokens=got * bs, nbytes=got * bpb, seconds=secs)
                    self._cost.observe_load(name, nbytes=got * bpb, seconds=secs, blocks=got)
                    tier.promotions += got
                    self._metrics.promotions += got
                if stop == "corrupt":
                    tier.corrupt_loads += 1
                    tier.fallbacks_to_recompute += 1
                elif stop == "recompute":
                    tier.fallbacks_to_recompute += 1
            if result is None:
                tier = self._metrics.tier("l3" if self._l2 is None else "l2")
                tier.failures += 1
                tier.fallbacks_to_recompute += 1
            if result:
                seq.lookup_hit_tokens += result["l3_lookup"] * bs
            seq.num_cached_tokens += n * bs
            seq.num_computed = seq.num_cached_tokens
            if n and not self._fence.stale(seq.flush_gen, seq.tag):
                r = seq.num_registered
                self._l1.register(seq.blocks[r : r + n], seq.hashes[r : r + n], seq.tokens[r * bs : (r + n) * bs],
                                  seq.tag)
                seq.num_registered += n
            if n3 and self._l3 is not None:  # the chunks it loaded from L3 are there already
                seq.l3_chunks = seq.num_registered // self._l3.chunk_blocks
            seq.load_blocks = []
            self.record(seq)
        return seq.num_cached_tokens

    def _late_arrival(self, seq: CachedSequence, future) -> None:
        try:
            result = future.result()
            n = result["l2"] + result["l3"]
        except Exception:
            return
        with self._lock:
            self._metrics.usage(seq.tag.owner, seq.tag.model).load_success_tokens += n * self._bs
            self._metrics.tier("l2").late_loads += 1
