"""CacheEngine: the orchestrator over the block stores (L1 device pages, L2 host memory).

It is not a store. Per request it computes the hash chain once, asks L1 and then L2 for the longest
contiguous exact-prefix hit, decides whether loading the L2 part beats recomputing it
(:mod:`cachecore.loadcost`), holds the L1 hit, allocates the rest, and starts the L2 load at once
(prefetch: it overlaps with the request's wait for its model turn). A request's life:

``admit`` -> ``finish_loads`` (the promoted prefix is copied into the request's fresh L1 pages, or
falls back to recompute when it failed, was corrupt or missed its deadline) -> the model writes KV for
positions ``>= seq.num_cached_tokens`` through ``seq.block_table`` -> ``commit`` registers every full
block whose KV now exists -> ``release`` frees the blocks (deepest first in the eviction order).
Hit blocks are shared and read-only: a hit is always block-aligned, so new KV lands only in blocks
this request allocated.

Blocks go down by the write policy (:mod:`cachecore.writeback`): L1 announces what it drops to its
listeners, and the default write-back copies an evicted block to L2 at that moment. Flushes are per
scope: a request admitted before a flush registers nothing the flush matches, while other tenants'
requests keep caching.

All public methods are thread-safe (one lock); model forwards and L2 loads run outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from cachecore.block_pool import Block
from cachecore.config import EngineConfig
from cachecore.errors import InflightLimit, InvalidKV, InvalidPrompt
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.loadcost import LoadCost
from cachecore.metrics import CacheMetrics
from cachecore.namespace import Namespace
from cachecore.sequence import CachedSequence
from cachecore.tiers.base import Retrieved, Tag, Tier
from cachecore.tiers.device import DeviceStore
from cachecore.tiers.host import HostStore
from cachecore.writeback import WritePolicy, Writer

__all__ = ["CacheEngine", "CachedSequence", "EngineConfig", "Tag"]

_HASH_BATCH = 16  # blocks hashed per lock round trip in the KV API's lookup and retrieve


class CacheEngine(Tier):
    """Orchestrator over L1 (``num_blocks`` device pages, allocated once) and, when
    ``config.l2_blocks > 0``, an L2 host pool. ``pool`` and ``pages`` are L1's."""

    name = "engine"

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        metrics: CacheMetrics | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.layout = layout
        self.block_size = layout.block_size
        self._lock = threading.RLock()
        self.l1 = DeviceStore(layout, num_blocks, device, self._lock)
        self.l2 = HostStore(layout, self.config.l2_blocks, pin_memory=self.config.pin_memory) \
            if self.config.l2_blocks else None
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
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="strata-l2-load") if self.l2 else None
        self._writer = Writer() if self.l2 and self.write_policy.on_commit else None
        # Blocks L1 evicted during the allocation in progress, written to L2 in one copy right after it
        # (before anything can overwrite them); None outside ``_allocate`` (then written one by one).
        self._demoting: list[tuple[Block, bytes, tuple, Tag]] | None = None
        if self.l2 is not None:
            self.pool.listeners.append(self._on_l1_drop)

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
    ) -> CachedSequence:
        """Find the longest usable exact-prefix hit (L1, then L2), hold the L1 part, allocate blocks for
        the rest of the prompt plus ``max_new_tokens`` and start loading the L2 part into the first of
        them (call ``finish_loads`` before computing). The last prompt token is never served from cache
        (its logits are needed), so the hit is at most ``len(tokens) - 1`` rounded down to a block
        boundary; ``recompute_last=False`` lifts that rule for callers that only move KV (``store``).

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
            if l2_items and not self.cost.should_load("l2", nbytes=len(l2_items) * self.layout.bytes_per_block,
                                                      tokens=len(l2_items) * bs):
                self.metrics.tier("l2").fallbacks_to_recompute += 1
                l2_items = []
            total = -(-(len(tokens) + max_new_tokens) // bs)
            held = self._inflight.get(owner, 0)
            if held and held + total > self.inflight_limit(owner):
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
                flush_gen=self._gen, use_cache=use_cache, l1_hit_tokens=hit_tokens,
            )
            self._gens_in_use[seq.flush_gen] += 1
            self._running[seq.seq_id] = seq
            self._inflight[owner] = held + len(seq.blocks)
            if hit_tokens:
                self.metrics.observe_load("l1", tokens=hit_tokens, nbytes=0, seconds=time.perf_counter() - t0)
            if l2_items:
                seq.load_blocks = fresh[: len(l2_items)]
                seq.load_started = time.perf_counter()
                seq.pending = self._loader.submit(self.l2.get, l2_items)
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

    def finish_loads(self, seq: CachedSequence) -> int:
        """Wait (up to the load deadline) for the L2 prefix started by ``admit`` and copy it into the
        request's pages; a block that did not arrive in time, failed or was corrupt is a miss for it
        and every block after it (recomputed). Returns the final ``num_cached_tokens``. Idempotent."""
        future, seq.pending = seq.pending, None
        if future is None:
            return seq.num_cached_tokens
        bs, wanted = self.block_size, len(seq.load_blocks)
        waited = self.config.load_deadline_s - (time.perf_counter() - seq.load_started)
        outcome = None
        try:
            fetched = future.result(timeout=max(0.0, waited))
            kv, outcome = fetched.kv, fetched.stopped
        except FutureTimeout:
            kv, outcome = None, "late"
            future.add_done_callback(lambda f, seq=seq: self._late_arrival(seq, f))
        except Exception:
            kv, outcome = None, "failed"
        n = 0 if kv is None else int(kv.shape[0])
        if n:
            self.l1.write(seq.load_blocks[:n], kv)
        seconds = time.perf_counter() - seq.load_started
        with self._lock:
            tier = self.metrics.tier("l2")
            if n:
                nbytes = n * self.layout.bytes_per_block
                self.metrics.observe_load("l2", tokens=n * bs, nbytes=nbytes, seconds=seconds)
                self.cost.observe_load("l2", nbytes=nbytes, seconds=seconds, blocks=n)
                tier.promotions += n
                self.metrics.promotions += n
            if n < wanted:
                tier.fallbacks_to_recompute += 1
                if outcome == "corrupt":
                    tier.corrupt_loads += 1
                else:
                    tier.failures += 1
            seq.num_cached_tokens += n * bs
            seq.num_computed = seq.num_cached_tokens
            if n and not self._stale(seq):
                for i in range(seq.num_registered, seq.num_registered + n):
                    self.pool.cache(seq.blocks[i], seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]),
                                    seq.tag.owner, seq.tag)
                seq.num_registered += n
            seq.load_blocks = []
            self._record_query(seq)
        return seq.num_cached_tokens

    def _record_query(self, seq: CachedSequence) -> None:
        # Load success counts bytes that arrived in time; bytes that arrive after the deadline are
        # added by ``_late_arrival`` (they arrived, but the prefill was not skipped).
        self.metrics.record_query(
            tenant=seq.tag.owner, model=seq.tag.model, query_tokens=seq.prompt_len,
            lookup_hit_tokens=seq.lookup_hit_tokens, load_success_tokens=seq.num_cached_tokens,
            effective_hit_tokens=seq.num_cached_tokens,
        )

    def _late_arrival(self, seq: CachedSequence, future) -> None:
        try:
            n = int(future.result().kv.shape[0])
        except Exception:
            return
        with self._lock:
            self.metrics.usage(seq.tag.owner, seq.tag.model).load_success_tokens += n * self.block_size
            self.metrics.tier("l2").late_loads += 1

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
        with self._lock:
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
            for i in range(seq.num_registered, full):
                block = seq.blocks[i]
                kept = self.pool.cache(block, seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]),
                                       seq.tag.owner, seq.tag)
                if kept is block and block.block_hash is not None:
                    new.append(block)
            seq.num_registered = full
            self.metrics.usage(seq.tag.owner, seq.tag.model).stored_tokens += len(new) * bs
            if new and self._writer is not None:
                self._write_through(new, seq.flush_gen)
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

    # ------------------------------------------------------------------ moving blocks down (L1 -> L2)
    def _allocate(self, n: int, owner: str) -> list[Block]:
        """``pool.allocate`` with the evicted blocks written down (by the policy) in one batch, while
        their pages still hold their bytes (the new holder writes only after this returns)."""
        if self.l2 is None:
            return self.pool.allocate(n, owner)
        self._demoting = []
        try:
            blocks = self.pool.allocate(n, owner)
            batch = self._demoting
        finally:
            self._demoting = None
        if batch:
            kv = self.l1.read([b for b, _, _, _ in batch])
            stored = self.l2.put_many([(key, tokens, tag) for _, key, tokens, tag in batch], kv)
            self._count_demotion(stored)
        return blocks

    def _on_l1_drop(self, block: Block, reason: str) -> None:
        """L1 listener (under the lock): write an evicted block's bytes to L2 by the write policy."""
        tag = block.tag
        if tag is None or not self.write_policy.on_evict(reason=reason, hits=block.hits):
            return
        if (tag.model, tag.revision) in self._retired:
            return
        if self._demoting is not None:
            self._demoting.append((block, block.block_hash, block.token_ids, tag))
        elif self.l2.put(block.block_hash, block.token_ids, tag, self.l1.read([block])):
            self._count_demotion(1)

    def _count_demotion(self, n: int) -> None:
        tier = self.metrics.tier("l2")
        tier.demotions += n
        tier.bytes_in += n * self.layout.bytes_per_block

    def _write_through(self, blocks: list[Block], gen: int) -> None:
        """Hold ``blocks`` and copy them to L2 on the writer thread, then release them."""
        self.pool.touch(blocks)
        self._gens_in_use[gen] += 1
        entries = [(b.block_hash, b.token_ids, b.tag) for b in blocks]

        def job() -> None:
            try:
                kv = self.l1.read(blocks)
                with self._lock:
                    for (key, tokens, tag), page in zip(entries, kv, strict=True):
                        if not self._flushed_since(gen, tag) and (tag.model, tag.revision) not in self._retired \
                                and self.l2.put(key, tokens, tag, page):
                            self._count_demotion(1)
            finally:
                with self._lock:
                    self.pool.free(blocks)
                    self._release_gen(gen)

        self._writer.submit(job)

    def drain_writes(self) -> None:
        """Wait until every write-through copy submitted so far has landed (tests, benchmarks)."""
        if self._writer is not None:
            self._writer.drain()

    # ------------------------------------------------------------------ tier contract (KV API)
    def _walk(self, ns: Namespace, tokens: Sequence[int], request_salt: bytes, *, hold: bool
              ) -> tuple[list[Block], list[tuple[bytes, tuple]]]:
        """The contiguous hit of ``tokens``: L1 blocks, then the L2 items after them. Hashes are
        computed outside the lock a batch at a time and hashing stops at the first miss, so a long
        token list neither stalls other requests nor costs more than its hit. ``hold``: take a
        reference on each L1 block (the caller frees them)."""
        bs = self.block_size
        hits: list[Block] = []
        lower: list[tuple[bytes, tuple]] = []
        parent = None
        try:
            for start in range(0, len(tokens) - bs + 1, bs * _HASH_BATCH):
                part = tokens[start : start + bs * _HASH_BATCH]
                hashes = chain_hashes(ns, part, bs, request_salt=request_salt, parent=parent)
                with self._lock:
                    for i, h in enumerate(hashes):
                        block_tokens = tuple(part[i * bs : (i + 1) * bs])
                        block = None if lower else self.pool.get_cached(h, block_tokens)
                        if block is not None:
                            if hold:
                                self.pool.touch([block])
                            hits.append(block)
                        elif self.l2 is not None and self.l2.contains(h, block_tokens):
                            lower.append((h, block_tokens))
                        else:
                            return hits, lower
                parent = hashes[-1]
        except BaseException:
            if hold and hits:
                with self._lock:
                    self.pool.free(hits)
            raise
        return hits, lower

    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        hits, lower = self._walk(ns, list(tokens), request_salt, hold=False)
        return (len(hits) + len(lower)) * self.block_size

    def store(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        kv: torch.Tensor,
        *,
        owner: str,
        request_salt: bytes = b"",
        model: str = "",
        revision: str = "",
    ) -> int:
        tokens = list(tokens)
        n_blocks = len(tokens) // self.block_size
        if kv.dim() != 1 + len(self.layout.page_shape) or kv.shape[0] < n_blocks:
            raise InvalidKV(f"expected kv of shape [{n_blocks}, *{tuple(self.layout.page_shape)}]")
        if n_blocks == 0:
            return 0
        seq = self.admit(
            ns, tokens[: n_blocks * self.block_size], owner=owner, model=model, revision=revision,
            request_salt=request_salt, recompute_last=False,
        )
        try:
            have = self.finish_loads(seq) // self.block_size
            todo = seq.blocks[have:n_blocks]
            if todo:
                self.l1.write(todo, kv[have:n_blocks])
            self.mark_computed(seq, n_blocks * self.block_size)
            return self.commit(seq)
        finally:
            self.release(seq)

    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        tokens = list(tokens)
        t0 = time.perf_counter()
        hits, lower = self._walk(ns, tokens, request_salt, hold=True)
        try:
            parts = [self.l1.read(hits)] if hits else []
        finally:
            with self._lock:
                self.pool.free(hits)
        if lower:
            fetched = self.l2.get(lower)
            if fetched.kv.shape[0]:
                parts.append(fetched.kv.to(self.pages.device))
        kv = torch.cat(parts) if parts else torch.empty((0, *self.layout.page_shape), dtype=self.layout.torch_dtype)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[: kv.shape[0] * self.block_size] = True
        with self._lock:
            self.metrics.observe_load("l1", tokens=len(hits) * self.block_size,
                                      nbytes=len(hits) * self.layout.bytes_per_block, seconds=time.perf_counter() - t0)
        return Retrieved(kv, mask)

    # ------------------------------------------------------------------ operations
    def flush(self, match: Callable[[Tag], bool]) -> dict:
        """Drop every cached block whose tag matches, in every tier. Held blocks stay usable by their
        running request but can never be hit again; requests admitted before the flush and matching it
        register nothing. Returns ``{"blocks_freed", "tokens_dropped", "tiers": {"l1", "l2"}}``."""
        with self._lock:
            self._gen += 1
            if self._running or self._gens_in_use:
                self._flushes.append((self._gen, match))
            n1 = self.pool.drop_where(lambda b: b.tag is not None and match(b.tag))
            n2 = self.l2.delete(match) if self.l2 is not None else 0
            self.metrics.flushed_blocks += n1 + n2
            return {"blocks_freed": n1 + n2, "tokens_dropped": (n1 + n2) * self.block_size,
                    "tiers": {"l1": n1, "l2": n2}}

    def count_cached(self, match: Callable[[Tag], bool]) -> int:
        """Cached blocks (every tier) whose tag matches: 0 after a flush of ``match`` (the probe)."""
        with self._lock:
            return self.l1.count(match) + (self.l2.count(match) if self.l2 is not None else 0)

    def retire(self, model: str, revision: str) -> dict:
        """Stop admitting hits for (model, revision) and drop its blocks everywhere (rollout)."""
        with self._lock:
            self._retired.add((model, revision))
            return self.flush(lambda t: t.model == model and t.revision == revision)

    def unretire(self, model: str, revision: str) -> None:
        """Allow (model, revision) to hit and store again (it became active once more)."""
        with self._lock:
            self._retired.discard((model, revision))

    def set_tenant_cap(self, owner: str, max_tokens: int | None) -> None:
        with self._lock:
            self.pool.set_cap(owner, max_tokens)

    def set_inflight_limit(self, owner: str, max_tokens: int | None) -> None:
        """Tokens ``owner``'s running requests may hold at once (``None``: the default, half the pool)."""
        with self._lock:
            if max_tokens is None:
                self._inflight_limits.pop(owner, None)
            else:
                self._inflight_limits[owner] = max(1, int(max_tokens) // self.block_size)

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

    def snapshot(self) -> dict:
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
            snap["resident_blocks"] = resident
            snap["bytes_per_block"] = self.layout.bytes_per_block
            snap["load_policy"] = self.cost.snapshot()
            snap["write_policy"] = self.write_policy.name
            return snap
