"""CacheEngine: the orchestrator over the block stores (L1 device pages, L2 host memory, L3 remote).

It is not a store. Per request it computes the hash chain once, asks L1 and then L2 for the longest
contiguous exact-prefix hit, decides whether loading the L2 part beats recomputing it
(:mod:`cachecore.loadcost`), holds the L1 hit, allocates the rest, and starts the lower-tier load at
once (prefetch: it overlaps with the request's wait for its model turn). The L3 part is found by the
loader thread, never under the lock: it probes the encrypted remote store for the chunks after the
L2 prefix, decides load or recompute with L3's own measured bandwidth, and fetches them. A request's
life:

``admit`` -> ``finish_loads`` (the promoted prefix is copied into the request's fresh L1 pages, or
falls back to recompute when it failed, was corrupt or missed its deadline) -> the model writes KV for
positions ``>= seq.num_cached_tokens`` through ``seq.block_table`` -> ``commit`` registers every full
block whose KV now exists -> ``release`` frees the blocks (deepest first in the eviction order).
Hit blocks are shared and read-only: a hit is always block-aligned, so new KV lands only in blocks
this request allocated.

Blocks go down by the write policy (:mod:`cachecore.writeback`): L1 announces what it drops to its
listeners, and the default write-back copies an evicted block to L2 at that moment. L3 objects are
chunks of consecutive blocks; a chunk is written to L3 in the background as soon as a request has
committed all of it (write-through: what a restart keeps), unless the request or tenant forbids
persistence. Flushes are per
scope: a request admitted before a flush registers nothing the flush matches, while other tenants'
requests keep caching.

KV events (``events``, an :class:`~cachecore.events.EventLog`): every tier announces what it stores
and drops (L1 through this engine's commits and its pool's listeners, L2 and L3 through their stores'
hooks), one batch per store operation; see :mod:`cachecore.events`.

Named caches (:mod:`cachecore.engine_pins`): ``resident`` / ``pin`` / ``drop`` of one prefix in every
tier (soft pins by hash in L1, L2 and L3).

All public methods are thread-safe (one lock); model forwards and L2 loads run outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from cachecore.block_pool import Block
from cachecore.config import EngineConfig
from cachecore.engine_kv import KVApiMixin
from cachecore.engine_loads import LoadsMixin
from cachecore.engine_pins import PinsMixin
from cachecore.engine_writes import WritesMixin
from cachecore.errors import InflightLimit, InvalidPrompt
from cachecore.event_recorders import wire_engine
from cachecore.events import EventLog
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.loadcost import LoadCost
from cachecore.metrics import CacheMetrics
from cachecore.namespace import Namespace
from cachecore.sequence import CachedSequence
from cachecore.tiers.base import Tag, Tier
from cachecore.tiers.device import DeviceStore
from cachecore.tiers.host import HostStore
from cachecore.tiers.remote import RemoteStore, l3_figures
from cachecore.writeback import WritePolicy, Writer

__all__ = ["CacheEngine", "CachedSequence", "EngineConfig", "Tag"]


class CacheEngine(LoadsMixin, WritesMixin, KVApiMixin, PinsMixin, Tier):
    """Orchestrator over L1 (``num_blocks`` device pages, allocated once) and, when
    ``config.l2_blocks > 0``, an L2 host pool. ``pool`` and ``pages`` are L1's. Every tier, the L3
    store given included, evicts by ``config.eviction_policy`` (:mod:`cachecore.eviction`)."""

    name = "engine"

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        metrics: CacheMetrics | None = None,
        config: EngineConfig | None = None,
        l3: RemoteStore | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.l3 = l3
        self.layout = layout
        self.block_size = layout.block_size
        self._lock = threading.RLock()
        policy = self.config.eviction_policy  # every tier evicts by it (each with its own instance)
        self.l1 = DeviceStore(layout, num_blocks, device, self._lock, eviction_policy=policy)
        self.l2 = HostStore(layout, self.config.l2_blocks, pin_memory=self.config.pin_memory,
                            eviction_policy=policy) if self.config.l2_blocks else None
        if l3 is not None and l3.eviction_policy.name != policy:
            l3.use_eviction_policy(policy)
        self.pool = self.l1.pool
        self.pages = self.l1.pages
        self.metrics = metrics or CacheMetrics()
        self.cost = LoadCost(self.config.load_policy)
        self.write_policy = WritePolicy(self.config.write_policy, self.config.selective_min_hits)
        self._ids = itertools.count(1)
        self._retired: set[tuple[str, str]] = set()  # (model, revision) that may neither hit nor store
        # Per-scope flush generations: (generation, match) of recent flushes, kept while a request or
        # a pending write admitted before them is alive.
        self._gen = 0
        self._flushes: list[tuple[int, Callable[[Tag], bool]]] = []
        self._gens_in_use: Counter[int] = Counter()
        self._running: dict[int, CachedSequence] = {}
        # Blocks held by each owner's running requests, and per-owner limits on them (in blocks).
        self._inflight: dict[str, int] = {}
        self._inflight_limits: dict[str, int] = {}
        self.default_inflight_blocks = max(1, num_blocks // 2)
        lower = self.l2 is not None or self.l3 is not None
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="strata-load") if lower else None
        self._writer = Writer() if self.l2 and self.write_policy.on_commit else None
        self._l3_writer = Writer("strata-l3-writer") if self.l3 is not None else None
        # Blocks L1 evicted during the allocation in progress, written to L2 in one copy right after it
        # (before anything can overwrite them); None outside ``_allocate`` (then written one by one).
        self._demoting: list[tuple[Block, bytes, tuple, Tag]] | None = None
        if self.l2 is not None:
            self.pool.listeners.append(self._on_l1_drop)
        self.events = events
        self._l1_events = wire_engine(events, self) if events is not None else None

    # ------------------------------------------------------------------ serving path
    def admit(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        *,
        owner: str,
        model: str = "",
        revision: str = "",
        request_salt: bytes = b"",
        max_new_tokens: int = 0,
        use_cache: bool = True,
        recompute_last: bool = True,
        persist: bool = True,
        retention_seconds: float | None = None,
    ) -> CachedSequence:
        """Find the longest usable exact-prefix hit (L1, then L2), hold the L1 part, allocate blocks for
        the rest of the prompt plus ``max_new_tokens`` and start loading the L2 part into the first of
        them (call ``finish_loads`` before computing). The last prompt token is never served from cache
        (its logits are needed), so the hit is at most ``len(tokens) - 1`` rounded down to a block
        boundary; ``recompute_last=False`` lifts that rule for callers that only move KV (``store``).
        ``persist=False``: the request neither reads nor writes L3. ``retention_seconds``: L3 serves
        it nothing older, and the L3 chunks it writes expire after it (their own, authenticated expiry).

        Raises ``OutOfBlocks`` (nothing held) when the pool cannot fit the request now without
        evicting another owner's protected share, and ``InflightLimit`` when ``owner``'s running
        requests already hold its in-flight limit (a request is always admitted when the owner holds
        nothing, so one request up to the context length always fits)."""
        tokens = list(tokens)
        if not tokens:
            raise InvalidPrompt("prompt is empty")
        bs = self.block_size
        tag = Tag(owner, model, revision, ns.digest, persist)
        use_cache = use_cache and (model, revision) not in self._retired
        hashes = chain_hashes(ns, tokens, bs, request_salt=request_salt) if use_cache else []
        t0 = time.perf_counter()
        with self._lock:
            index_hits = self.l1.match(hashes, tokens)
            limit = (len(tokens) - int(recompute_last)) // bs
            usable = index_hits[:limit]
            l2_items = self._l2_prefix(hashes, tokens, len(index_hits)) if len(usable) == len(index_hits) else []
            lookup_blocks = len(index_hits) + len(l2_items)
            l2_items = l2_items[: max(0, limit - len(usable))]
            l2_found = len(l2_items)  # the L2 prefix as found (before the cost decision)
            declined = None
            if l2_items and not self.cost.should_load("l2", nbytes=len(l2_items) * self.layout.bytes_per_block,
                                                      tokens=len(l2_items) * bs):
                self.metrics.tier("l2").fallbacks_to_recompute += 1
                l2_items, declined = [], "recompute"
            total = -(-(len(tokens) + max_new_tokens) // bs)
            held, allowed = self._inflight.get(owner, 0), self.inflight_limit(owner)
            # One request may exceed the limit alone (else a long prompt could never run); a limit
            # of 0 admits nothing.
            if (held or not allowed) and held + total > allowed:
                raise InflightLimit("this tenant has too many tokens in flight; retry when a request finishes")
            self.pool.hit(usable)
            try:
                fresh = self._allocate(total - len(usable), owner)
            except Exception:
                self.pool.free(usable)
                raise
            hit_tokens = len(usable) * bs
            seq = CachedSequence(
                seq_id=next(self._ids), ns=ns, tag=tag, request_salt=request_salt, tokens=tokens,
                prompt_len=len(tokens), blocks=usable + fresh, hashes=hashes, num_cached_tokens=hit_tokens,
                lookup_hit_tokens=lookup_blocks * bs, num_computed=hit_tokens, num_registered=len(usable),
                flush_gen=self._gen, use_cache=use_cache,
            )
            seq.retention_seconds = retention_seconds
            seq.tier_tokens["l1"] = hit_tokens
            seq.load_stop = declined
            self._gens_in_use[seq.flush_gen] += 1
            self._running[seq.seq_id] = seq
            self._inflight[owner] = held + len(seq.blocks)
            if hit_tokens:
                self.metrics.observe_load("l1", tokens=hit_tokens, nbytes=0, seconds=time.perf_counter() - t0)
            # L3 may hold chunks after the L1+L2 prefix (unless L2 already stops short of it). A
            # request that may not persist (the tenant turned persistence off, or "in_memory") never
            # reads L3 either: what a tenant withdrew from L3 must stop being served at once.
            covered = len(usable) + len(l2_items)
            try_l3 = (self.l3 is not None and use_cache and persist and covered < limit
                      and (covered // self.l3.chunk_blocks + 1) * self.l3.chunk_blocks <= len(hashes)
                      and len(l2_items) == l2_found)
            if l2_items or try_l3:
                seq.load_blocks = fresh[: (limit - len(usable)) if try_l3 else len(l2_items)]
                seq.load_started = time.perf_counter()
                seq.pending = self._loader.submit(self._load, seq, l2_items, len(usable), limit, try_l3)
            else:
                self._record_query(seq)
            return seq

    def _l2_prefix(self, hashes: list[bytes], tokens: list[int], start: int) -> list[tuple[bytes, tuple]]:
        if self.l2 is None:
            return []
        bs = self.block_size
        items = []
        for i in range(start, len(hashes)):
            item = (hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            if not self.l2.contains(*item):
                break
            items.append(item)
        return items

    def _record_query(self, seq: CachedSequence) -> None:
        # Load success counts bytes that arrived in time; bytes that arrive after the deadline are
        # added by ``_late_arrival`` (they arrived, but the prefill was not skipped).
        self.metrics.record_query(
            tenant=seq.tag.owner, model=seq.tag.model, query_tokens=seq.prompt_len,
            lookup_hit_tokens=seq.lookup_hit_tokens, load_success_tokens=seq.num_cached_tokens,
            effective_hit_tokens=seq.num_cached_tokens,
        )

    def record_prefill(self, seq: CachedSequence, *, seconds: float, computed: int) -> None:
        """The model computed ``computed`` prompt tokens of ``seq`` in ``seconds`` (metrics, cost model)."""
        with self._lock:
            self.metrics.record_prefill(tenant=seq.tag.owner, model=seq.tag.model, seconds=seconds,
                                        computed=computed, skipped=seq.num_cached_tokens)
            self.cost.observe_prefill(tokens=computed, seconds=seconds)

    def append_token(self, seq: CachedSequence, token: int) -> None:
        """Record a generated token (its KV is written by the next forward)."""
        if len(seq.tokens) >= len(seq.blocks) * self.block_size:
            raise RuntimeError("sequence outgrew its allocation; admit with a larger max_new_tokens")
        seq.tokens.append(int(token))

    def mark_computed(self, seq: CachedSequence, upto: int) -> None:
        """The KV of ``seq.tokens[:upto]`` is now in the pages."""
        seq.num_computed = max(seq.num_computed, upto)

    def commit(self, seq: CachedSequence) -> int:
        """Register every full block whose KV exists. Returns blocks newly registered. A sequence admitted
        before a flush that matches it, or of a retired revision, registers nothing (a flush must stay
        flushed); other tenants' sequences keep caching. With write-through, the new blocks are copied
        to L2 in the background."""
        bs = self.block_size
        with self._lock, self.pool.batch():
            full = seq.num_computed // bs
            if not seq.use_cache or self._stale(seq) or full <= seq.num_registered:
                return 0
            if len(seq.hashes) < full:
                start = len(seq.hashes)
                seq.hashes += chain_hashes(
                    seq.ns, seq.tokens[start * bs : full * bs], bs, request_salt=seq.request_salt,
                    parent=seq.hashes[-1] if seq.hashes else None,
                )
            new: list[Block] = []
            prompt_blocks = seq.prompt_len // bs
            for i in range(seq.num_registered, full):
                block = seq.blocks[i]
                kept = self.pool.cache(block, seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]),
                                       seq.tag.owner, seq.tag)
                if kept is block and block.block_hash is not None:
                    new.append(block)
                    if i < prompt_blocks:
                        seq.written_tokens += bs
            seq.num_registered = full
            if new and self._l1_events is not None:
                self._l1_events.stored([b.block_hash for b in new])
            self.metrics.usage(seq.tag.owner, seq.tag.model).stored_tokens += len(new) * bs
            if new and self._writer is not None:
                self._write_through(new, seq.flush_gen)
            if self._l3_writer is not None and seq.tag.persist:
                self._write_chunks(seq)
            return len(new)

    def _stale(self, seq: CachedSequence) -> bool:
        return (seq.tag.model, seq.tag.revision) in self._retired or self._flushed_since(seq.flush_gen, seq.tag)

    def _flushed_since(self, gen: int, tag: Tag) -> bool:
        return any(g > gen and match(tag) for g, match in self._flushes)

    def release(self, seq: CachedSequence) -> None:
        """Commit what is computed, then free the request's blocks. Idempotent."""
        with self._lock:
            if seq.released:
                return
            if seq.pending is not None:  # never waited for: its blocks were not computed, nothing to keep
                seq.pending, seq.load_blocks = None, []
            self.commit(seq)
            self._finish(seq)

    def abort(self, seq: CachedSequence) -> None:
        """Free without registering anything (the request failed; its KV may be partial)."""
        with self._lock:
            if seq.released:
                return
            seq.pending = None  # a load still in flight copies into a scratch tensor nobody reads
            self._finish(seq)

    def _finish(self, seq: CachedSequence) -> None:
        seq.released = True
        self._running.pop(seq.seq_id, None)
        owner = seq.tag.owner
        left = self._inflight.get(owner, 0) - len(seq.blocks)
        if left > 0:
            self._inflight[owner] = left
        else:
            self._inflight.pop(owner, None)
        self.pool.free(seq.blocks)
        self._release_gen(seq.flush_gen)

    def _release_gen(self, gen: int) -> None:
        self._gens_in_use[gen] -= 1
        if not self._gens_in_use[gen]:
            del self._gens_in_use[gen]
        oldest = min(self._gens_in_use, default=self._gen)
        if self._flushes and self._flushes[0][0] <= oldest:
            self._flushes = [(g, m) for g, m in self._flushes if g > oldest]

    # ------------------------------------------------------------------ operations
    def flush(self, match: Callable[[Tag], bool], *, l3_scope: dict | None = None) -> dict:
        """Drop every cached block whose tag matches, in every tier (L3: the objects of ``l3_scope``,
        ``{"tenant"?, "model"?, "revision"?, "key_version"?}``, the same scope by name; None leaves
        L3 alone). Held blocks stay usable by their running request but can never be hit again;
        requests admitted before the flush and matching it register nothing, and an L3 write of such
        a request that lands later is deleted. Returns ``{"blocks_freed", "tokens_dropped", "tiers":
        {"l1", "l2", "l3"}, "l3_bytes"}``. Raises ``BackendUnavailable`` when L3 could not be reached
        (L1 and L2 are flushed by then; retry the flush)."""
        with self._lock:
            self._gen += 1
            if self._running or self._gens_in_use:
                self._flushes.append((self._gen, match))
            n1 = self.pool.drop_where(lambda b: b.tag is not None and match(b.tag))
            n2 = self.l2.delete(match) if self.l2 is not None else 0
            self.metrics.flushed_blocks += n1 + n2
        n3 = b3 = 0
        if self.l3 is not None and l3_scope is not None:
            # Writes submitted before this flush finish first (the matching ones skip themselves),
            # so none of them can land after the delete below.
            self._l3_writer.drain()
            n3, b3 = self.l3.delete_scope(**l3_scope)
        return {"blocks_freed": n1 + n2 + n3 * (self.l3.chunk_blocks if self.l3 else 0),
                "tokens_dropped": (n1 + n2) * self.block_size, "tiers": {"l1": n1, "l2": n2, "l3": n3},
                "l3_bytes": b3}

    def count_cached(self, match: Callable[[Tag], bool], *, l3_scope: dict | None = None) -> int:
        """Cached blocks (every tier; L3 objects of ``l3_scope`` count a chunk each) whose tag
        matches: 0 after a flush of the same scope (the probe)."""
        with self._lock:
            n = self.l1.count(match) + (self.l2.count(match) if self.l2 is not None else 0)
        if self.l3 is not None and l3_scope is not None:
            n += self.l3.count_scope(**l3_scope)[0]
        return n

    def retire(self, model: str, revision: str) -> dict:
        """Stop admitting hits for (model, revision) and drop its blocks everywhere (rollout)."""
        with self._lock:
            self._retired.add((model, revision))
        return self.flush(lambda t: t.model == model and t.revision == revision,
                          l3_scope={"model": model, "revision": revision})

    def unretire(self, model: str, revision: str) -> None:
        """Allow (model, revision) to hit and store again (it became active once more)."""
        with self._lock:
            self._retired.discard((model, revision))

    def set_tenant_cap(self, owner: str, max_tokens: int | None) -> None:
        with self._lock:
            self.pool.set_cap(owner, max_tokens)

    def set_weight(self, owner: str, weight: int | None) -> None:
        """Weight of ``owner``'s fair share of L1, L2 and L3 (``None``: 1, an equal share).
        ``ValueError`` unless an int >= 1."""
        with self._lock:
            for pool in (self.pool, getattr(self.l2, "pool", None)):
                if pool is not None:
                    pool.set_weight(owner, 1 if weight is None else weight)
            if self.l3 is not None:
                self.l3.set_weight(owner, weight)

    def set_inflight_limit(self, owner: str, max_tokens: int | None) -> None:
        """Tokens ``owner``'s running requests may hold at once (``None``: the default, half the pool;
        0: none, never the default; any other value at least one block)."""
        with self._lock:
            if max_tokens is None:
                self._inflight_limits.pop(owner, None)
            else:
                tokens = int(max_tokens)
                self._inflight_limits[owner] = max(1, tokens // self.block_size) if tokens > 0 else 0

    def inflight_limit(self, owner: str) -> int:
        """Blocks ``owner``'s running requests may hold at once."""
        return self._inflight_limits.get(owner, self.default_inflight_blocks)

    def inflight_blocks(self, owner: str) -> int:
        with self._lock:
            return self._inflight.get(owner, 0)

    def running(self) -> list[CachedSequence]:
        with self._lock:
            return list(self._running.values())

    def check_integrity(self) -> None:
        with self._lock:
            self.l1.check_integrity()
            if self.l2 is not None:
                self.l2.check_integrity()
            held: dict[str, int] = {}
            for seq in self._running.values():
                held[seq.tag.owner] = held.get(seq.tag.owner, 0) + len(seq.blocks)
            assert held == self._inflight, f"in-flight blocks {self._inflight} != running requests {held}"

    def gauges(self) -> dict[str, int]:
        gauges = self.l1.gauges()
        gauges["block_size"] = self.block_size
        return gauges

    def snapshot(self, l3_scope: tuple[str, str] | None = None) -> dict:
        """Metrics and tier figures. ``l3_scope`` ``(model, revision)``: the L3 row counts that
        deployment revision's objects (``RemoteStore.gauges``), since the store is shared."""
        with self._lock:
            l1 = self.gauges()
            snap = self.metrics.snapshot(l1)
            snap["evictions"] = l1["evictions"]
            snap["duplicate_stores"] = l1["duplicate_stores"]
            snap["tiers"].setdefault("l1", self.metrics.tier_row("l1")).update(
                capacity_blocks=l1["total"], used_blocks=l1["used"], evictions=l1["evictions"])
            resident = {"l1": self.l1.resident()}
            if self.l2 is not None:
                l2 = self.l2.gauges()
                snap["tiers"].setdefault("l2", self.metrics.tier_row("l2")).update(
                    capacity_blocks=l2["total"], used_blocks=l2["used"], evictions=l2["evictions"],
                    rejected_puts=l2["rejected"])
                resident["l2"] = self.l2.resident()
            l3_row = self.metrics.tier_row("l3") if self.l3 is not None else None
            snap["bytes_per_block"] = self.layout.bytes_per_block
            snap["load_policy"] = self.cost.snapshot()
            snap["write_policy"] = self.write_policy.name
        if self.l3 is not None:  # outside the lock: the store may list its backend
            l3 = self.l3.gauges(l3_scope)
            l3_row.update(l3_figures(l3, self.l3.chunk_blocks, self.layout.bytes_per_block))
            snap["tiers"]["l3"] = l3_row
            resident["l3"] = {t: b // self.layout.bytes_per_block
                              for t, b in self.l3.usage_by_tenant(scope=l3_scope).items()}
        snap["resident_blocks"] = resident
        return snap
