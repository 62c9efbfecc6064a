"""CacheEngine: the orchestrator over the block stores (L1 device pages, L2 host memory, L3 remote).

It is not a store. Per request it computes the hash chain once, asks L1 and then L2 for the longest
contiguous exact-prefix hit, holds the L1 hit, allocates the rest, and starts the lower-tier load at
once (prefetch: it overlaps with the request's wait for its model turn). A request's life:

``admit`` -> ``finish_loads`` (the promoted prefix is copied into the request's fresh L1 pages, or
falls back to recompute when it failed, was corrupt or missed its deadline) -> the model writes KV for
positions ``>= seq.num_cached_tokens`` through ``seq.block_table`` -> ``commit`` registers every full
block whose KV now exists -> ``release`` frees the blocks (deepest first in the eviction order).
Hit blocks are shared and read-only: a hit is always block-aligned, so new KV lands only in blocks
this request allocated.

The work is done by roles, each with one job and the collaborators it is given; the engine builds
them and keeps the lock, the running requests and the hash chain:

- ``fence`` (:mod:`cachecore.flush_fence`): flush generations and retired revisions; a request
  admitted before a flush registers nothing the flush matches, in any tier, while other tenants'
  requests keep caching.
- ``inflight`` (:mod:`cachecore.inflight`): the blocks each owner holds and their limits.
- ``promoter`` (:mod:`cachecore.promoter`): the L2 prefix after the L1 hit, load or recompute, and the
  L2/L3 loads on a loader thread (L3 probed there, never under the lock), with a deadline.
- ``demoter`` (:mod:`cachecore.demoter`, with an L2): blocks go down to L2 by the write policy.
- ``chunk_writer`` (:mod:`cachecore.chunk_writer`, with an L3): committed chunks written to L3 in
  the background, unless the request or tenant forbids persistence.
- ``kv_transfer`` (:mod:`cachecore.kv_transfer`): the KV API, ``lookup / store / retrieve``.
- ``named_caches`` (:mod:`cachecore.engine_pins`): ``resident`` / ``pin`` / ``drop`` of one prefix.
- ``tiers`` (:mod:`cachecore.tiers.ops`): each tier behind one contract for flush, count, weights,
  integrity and the snapshot.

KV events (``events``, an :class:`~cachecore.events.EventLog`): every tier announces what it stores
and drops (L1 and L2 through their stores' and pools' listeners, L3 through its store's hooks), one
batch per store operation; see :mod:`cachecore.events`.

All public methods are thread-safe (one lock, shared with the roles); model forwards and lower-tier
loads run outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence

import torch

from cachecore.block_pool import Block
from cachecore.chunk_writer import ChunkWriter
from cachecore.config import EngineConfig
from cachecore.demoter import Demoter
from cachecore.engine_pins import NamedCaches
from cachecore.errors import InvalidPrompt
from cachecore.event_recorders import wire_engine
from cachecore.events import TIERS, EventLog
from cachecore.flush_fence import FlushFence
from cachecore.hashing import block_keys, chain_hashes, token_blocks
from cachecore.inflight import Inflight
from cachecore.kv_transfer import KVTransfer
from cachecore.layout import KVLayout
from cachecore.loadcost import LoadCost
from cachecore.metrics import CacheMetrics
from cachecore.namespace import Namespace
from cachecore.promoter import Promoter
from cachecore.sequence import CachedSequence
from cachecore.tiers.base import PrefixCache, Retrieved, Tag
from cachecore.tiers.device import DeviceStore
from cachecore.tiers.host import HostStore
from cachecore.tiers.ops import PooledOps, RemoteOps, TierOps
from cachecore.tiers.remote import RemoteStore
from cachecore.writeback import WritePolicy

__all__ = ["CacheEngine", "CachedSequence", "EngineConfig", "Tag"]


class CacheEngine(PrefixCache):
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
        self.config = config = config or EngineConfig()
        self.layout = layout
        self.block_size = layout.block_size
        self._lock = lock = threading.RLock()
        policy = config.eviction_policy  # every tier evicts by it (each with its own instance)
        self.l1 = DeviceStore(layout, num_blocks, device, lock, eviction_policy=policy)
        self.l2 = HostStore(layout, config.l2_blocks, pin_memory=config.pin_memory,
                            eviction_policy=policy) if config.l2_blocks else None
        self.l3 = l3
        if l3 is not None and l3.eviction_policy.name != policy:
            l3.use_eviction_policy(policy)
        self.pool = self.l1.pool
        self.pages = self.l1.pages
        self.metrics = metrics = metrics or CacheMetrics()
        self.cost = LoadCost(config.load_policy)
        self.write_policy = WritePolicy(config.write_policy, config.selective_min_hits)
        self._ids = itertools.count(1)
        self._running: dict[int, CachedSequence] = {}
        self.fence = fence = FlushFence(lock)
        self.inflight = Inflight(self.block_size, max(1, num_blocks // 2))
        self.promoter = Promoter(lock=lock, l1=self.l1, l2=self.l2, l3=l3, cost=self.cost, metrics=metrics,
                                 fence=fence, deadline_s=config.load_deadline_s)
        self.demoter = Demoter(lock=lock, l1=self.l1, l2=self.l2, policy=self.write_policy, fence=fence,
                               metrics=metrics) if self.l2 is not None else None
        self.chunk_writer = ChunkWriter(lock=lock, l1=self.l1, l3=l3, fence=fence,
                                        metrics=metrics) if l3 is not None else None
        # What happens after a commit, and what drain_writes waits for: L2 copies first, then L3 chunks.
        self._writes = [w for w in (self.demoter, self.chunk_writer) if w is not None]
        self.kv_transfer = KVTransfer(lock=lock, l1=self.l1, l2=self.l2, metrics=metrics, requests=self)
        self.named_caches = NamedCaches(lock=lock, l1=self.l1, l2=self.l2, l3=l3, demoter=self.demoter,
                                        metrics=metrics, drain=self.drain_writes)
        self.tiers: list[TierOps] = [PooledOps(self.l1)]
        if self.l2 is not None:
            self.tiers.append(PooledOps(self.l2))
        if l3 is not None:
            self.tiers.append(RemoteOps(l3, drain=self.chunk_writer.drain, bytes_per_block=layout.bytes_per_block))
        self.events = events
        if events is not None:
            wire_engine(events, self)

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
        count_query: bool = True,
    ) -> CachedSequence:
        """Find the longest usable exact-prefix hit (L1, then L2), hold the L1 part, allocate blocks for
        the rest of the prompt plus ``max_new_tokens`` and start loading the L2 part into the first of
        them (call ``finish_loads`` before computing). The last prompt token is never served from cache
        (its logits are needed), so the hit is at most ``len(tokens) - 1`` rounded down to a block
        boundary; ``recompute_last=False`` lifts that rule for callers that only move KV (``store``).
        ``count_query=False``: a request admitted again (preempted, or re-admitted for a longer hit)
        is not counted again in the metrics (one request, one query). ``persist=False``: the request
        neither reads nor writes L3. ``retention_seconds``: L3 serves
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
        use_cache = use_cache and not self.fence.retired(model, revision)
        blocks = token_blocks(tokens, bs) if use_cache else []

        def keys(run: Sequence[bytes], parent: bytes | None) -> list[bytes]:
            return block_keys(ns, run, request_salt=request_salt, parent=parent)

        t0 = time.perf_counter()
        with self._lock:
            limit = (len(tokens) - int(recompute_last)) // bs
            total = -(-(len(tokens) + max_new_tokens) // bs)
            self.inflight.check(owner, total)
            # One walk finds the L1 prefix, holds its usable part and gives every block's key: a hit's
            # is read from its block, the rest hashed (each block's key computed once per request).
            usable, found, hashes = self.pool.hit_prefix(tokens, blocks, keys, limit)
            try:
                plan = self.promoter.plan(hashes, tokens, found, limit - found)
                fresh = self._allocate(total - len(usable), owner)
            except Exception:
                self.pool.free(usable)
                raise
            hit_tokens = len(usable) * bs
            gen = self.fence.enter()
            seq = CachedSequence(
                seq_id=next(self._ids), ns=ns, tag=tag._replace(gen=gen), request_salt=request_salt, tokens=tokens,
                prompt_len=len(tokens), blocks=usable + fresh, hashes=hashes, num_cached_tokens=hit_tokens,
                lookup_hit_tokens=(found + plan.lookup) * bs, num_computed=hit_tokens,
                num_registered=len(usable), flush_gen=gen, use_cache=use_cache,
                count_query=count_query, token_blocks=blocks,
            )
            seq.retention_seconds = retention_seconds
            seq.tier_tokens["l1"] = hit_tokens
            self._running[seq.seq_id] = seq
            self.inflight.add(owner, len(seq.blocks))
            if hit_tokens:
                self.metrics.observe_load("l1", tokens=hit_tokens, nbytes=0, seconds=time.perf_counter() - t0)
            self.promoter.start(seq, fresh, plan, len(usable), limit)
            return seq

    def _allocate(self, n: int, owner: str) -> list[Block]:
        # With an L2, the blocks this allocation evicts go down in one copy (before they are overwritten).
        return self.demoter.allocate(n, owner) if self.demoter is not None else self.pool.allocate(n, owner)

    def finish_loads(self, seq: CachedSequence) -> int:
        """Wait for the lower-tier prefix ``admit`` started and copy it into the request's pages (see
        ``Promoter.finish``); returns the final ``num_cached_tokens``. Idempotent."""
        return self.promoter.finish(seq)

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
        flushed); other tenants' sequences keep caching. The new blocks then go down by the write
        policy (L2 copies with write-through) and completed L3 chunks are written, in the background."""
        bs = self.block_size
        with self._lock, self.pool.batch():
            full = seq.num_computed // bs
            if full <= seq.num_registered or not seq.use_cache or self.fence.stale(seq.flush_gen, seq.tag):
                return 0
            if len(seq.hashes) < full:
                start = len(seq.hashes)
                seq.hashes += chain_hashes(
                    seq.ns, seq.tokens[start * bs : full * bs], bs, request_salt=seq.request_salt,
                    parent=seq.hashes[-1] if seq.hashes else None,
                )
            first = seq.num_registered
            links = seq.token_blocks
            if len(links) < full:  # generated tokens filled more blocks
                links += token_blocks(seq.tokens[len(links) * bs : full * bs], bs)
            new = self.l1.register(seq.blocks[first:full], seq.hashes[first:full], seq.tokens[first * bs : full * bs],
                                   seq.tag, parent=seq.hashes[first - 1] if first else None, links=links[first:full])
            seq.num_registered = full
            prompt_blocks = seq.prompt_len // bs
            if new and first < prompt_blocks:  # its own prompt blocks it added to L1
                if full <= prompt_blocks:
                    seq.written_tokens += bs * len(new)
                else:
                    prompt = {b.block_id for b in seq.blocks[first:prompt_blocks]}
                    seq.written_tokens += bs * sum(b.block_id in prompt for b in new)
            self.metrics.usage(seq.tag.owner, seq.tag.model).stored_tokens += len(new) * bs
            for writes in self._writes:
                writes.committed(seq, new)
            return len(new)

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
        self.inflight.remove(seq.tag.owner, len(seq.blocks))
        self.pool.free(seq.blocks)
        self.fence.leave(seq.flush_gen)

    def l3_writing(self) -> bool:
        """Whether L3 chunks are being written in the background right now (the scheduler keeps a step
        of prompt chunks on its steady threads meanwhile: ``cachecore.scheduler.threads``)."""
        return self.chunk_writer is not None and self.chunk_writer.writing()

    def drain_writes(self) -> None:
        """Wait until every background write submitted so far has landed (tests, benchmarks)."""
        for writes in self._writes:
            writes.drain()

    # ------------------------------------------------------------------ the KV API and named caches
    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        return self.kv_transfer.lookup(ns, tokens, request_salt=request_salt)

    def store(self, ns: Namespace, tokens: Sequence[int], kv: torch.Tensor, *, owner: str, request_salt: bytes = b"",
              model: str = "", revision: str = "") -> int:
        return self.kv_transfer.store(ns, tokens, kv, owner=owner, request_salt=request_salt, model=model,
                                      revision=revision)

    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        return self.kv_transfer.retrieve(ns, tokens, request_salt=request_salt)

    def resident(self, ns: Namespace, tokens: Sequence[int], **prefix) -> dict[str, int]:
        """``NamedCaches.resident`` (``prefix``: ``request_salt``, ``owner``, ``model``, ``revision``)."""
        return self.named_caches.resident(ns, tokens, **prefix)

    def pin(self, ns: Namespace, tokens: Sequence[int], until: float | None, **prefix) -> dict[str, int]:
        """``NamedCaches.pin``."""
        return self.named_caches.pin(ns, tokens, until, **prefix)

    def commit_to_l2(self, ns: Namespace, tokens: Sequence[int], **prefix) -> dict[str, int]:
        """``NamedCaches.commit_to_l2``."""
        return self.named_caches.commit_to_l2(ns, tokens, **prefix)

    def drop(self, ns: Namespace, tokens: Sequence[int], **prefix) -> dict:
        """``NamedCaches.drop``."""
        return self.named_caches.drop(ns, tokens, **prefix)

    # ------------------------------------------------------------------ operations
    def flush(self, match: Callable[[Tag], bool], *, l3_scope: dict | None = None) -> dict:
        """Drop every cached block whose tag matches, in every tier (L3: the objects of ``l3_scope``,
        ``{"tenant"?, "model"?, "revision"?, "key_version"?}``, the same scope by name; None leaves
        L3 alone). Held blocks stay usable by their running request but can never be hit again;
        requests admitted before the flush and matching it register nothing, and an L3 write of such
        a request that lands later is deleted. Returns ``{"blocks_freed", "tokens_dropped", "tiers":
        {"l1", "l2", "l3"}, "l3_bytes"}``. Raises ``BackendUnavailable`` when L3 could not be reached
        (L1 and L2 are flushed by then; retry the flush). ``"generation"``: the fence's generation the flush
        opened (blocks cached from then on carry it or a later one: ``Tag.gen``)."""
        with self._lock:
            generation = self.fence.flush(match)
            done = {t.name: t.flush(match, l3_scope) for t in self.tiers if t.local}
            dropped = sum(f.blocks for f in done.values())
            self.metrics.flushed_blocks += dropped
        for t in self.tiers:
            if not t.local:
                done[t.name] = t.flush(match, l3_scope)
        return {"blocks_freed": sum(f.blocks for f in done.values()), "tokens_dropped": dropped * self.block_size,
                "tiers": {**dict.fromkeys(TIERS, 0), **{name: f.entries for name, f in done.items()}},
                "l3_bytes": sum(f.nbytes for f in done.values()), "generation": generation}

    def count_cached(self, match: Callable[[Tag], bool], *, l3_scope: dict | None = None) -> int:
        """Cached blocks (every tier; L3 objects of ``l3_scope`` count a chunk each) whose tag
        matches: 0 after a flush of the same scope (the probe)."""
        with self._lock:
            n = sum(t.count(match, l3_scope) for t in self.tiers if t.local)
        return n + sum(t.count(match, l3_scope) for t in self.tiers if not t.local)

    def retire(self, model: str, revision: str) -> dict:
        """Stop admitting hits for (model, revision) and drop its blocks everywhere (rollout)."""
        self.fence.retire(model, revision)
        return self.flush(lambda t: t.model == model and t.revision == revision,
                          l3_scope={"model": model, "revision": revision})

    def unretire(self, model: str, revision: str) -> None:
        """Allow (model, revision) to hit and store again (it became active once more)."""
        self.fence.unretire(model, revision)

    def set_tenant_cap(self, owner: str, max_tokens: int | None) -> None:
        with self._lock:
            self.pool.set_cap(owner, max_tokens)

    def set_weight(self, owner: str, weight: int | None) -> None:
        """Weight of ``owner``'s fair share of every tier (``None``: 1, an equal share).
        ``ValueError`` unless an int >= 1."""
        with self._lock:
            for t in self.tiers:
                t.set_weight(owner, weight)

    def set_inflight_limit(self, owner: str, max_tokens: int | None) -> None:
        """Tokens ``owner``'s running requests may hold at once (``None``: the default, half the pool;
        0: none, never the default; any other value at least one block)."""
        with self._lock:
            self.inflight.set_limit(owner, max_tokens)

    def inflight_limit(self, owner: str) -> int:
        """Blocks ``owner``'s running requests may hold at once."""
        return self.inflight.limit(owner)

    @property
    def default_inflight_blocks(self) -> int:
        return self.inflight.default_blocks

    def inflight_blocks(self, owner: str) -> int:
        with self._lock:
            return self.inflight.held(owner)

    def running(self) -> list[CachedSequence]:
        with self._lock:
            return list(self._running.values())

    def poison_free_pages(self) -> int:
        """NaN into every L1 page no request holds and no hash names, under the lock so none is
        allocated meanwhile (test hooks: a freed page must never be read); how many."""
        with self._lock:
            ids = [b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
            self.pages.poison(torch.tensor(ids, dtype=torch.long))
            return len(ids)

    def check_integrity(self) -> None:
        with self._lock:
            for t in self.tiers:
                t.check_integrity()
            held: dict[str, int] = {}
            for seq in self._running.values():
                held[seq.tag.owner] = held.get(seq.tag.owner, 0) + len(seq.blocks)
            self.inflight.check_integrity(held)

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
            rows = {t.name: snap["tiers"].setdefault(t.name, self.metrics.tier_row(t.name)) for t in self.tiers}
            resident: dict[str, dict[str, int]] = {}
            for t in self.tiers:
                if t.local:
                    fields, resident[t.name] = t.figures(l3_scope)
                    rows[t.name].update(fields)
            snap["bytes_per_block"] = self.layout.bytes_per_block
            snap["load_policy"] = self.cost.snapshot()
            snap["write_policy"] = self.write_policy.name
        for t in self.tiers:  # outside the lock: a remote store may list its backend
            if not t.local:
                fields, resident[t.name] = t.figures(l3_scope)
                rows[t.name].update(fields)
        snap["resident_blocks"] = resident
        return snap
