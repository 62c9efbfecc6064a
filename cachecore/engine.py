"""CacheEngine: the L1 prefix cache that joins the bookkeeping (BlockPool) to the bytes (KVPages).

A request's life: ``admit`` (hash chain, longest exact-prefix hit, hold the hit blocks, allocate the
rest) -> the model writes KV for positions ``>= seq.num_cached_tokens`` through ``seq.block_table`` ->
``commit`` registers every full block whose KV now exists -> ``release`` frees the blocks (deepest
first in the eviction order). Hit blocks are shared and read-only: a hit is always block-aligned, so
new KV lands only in blocks this request allocated.

All public methods are thread-safe (one lock); model forwards run outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cachecore.block_pool import Block, BlockPool
from cachecore.errors import InflightLimit, InvalidKV, InvalidPrompt
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.metrics import CacheMetrics
from cachecore.namespace import Namespace
from cachecore.pages import KVPages
from cachecore.tiers.base import Retrieved, Tier


class Tag(NamedTuple):
    """What a cached block belongs to; flushes select blocks by it."""

    owner: str
    model: str
    revision: str
    ns_digest: bytes


@dataclass(eq=False)
class CachedSequence:
    """A running request's cache state. ``tokens`` grows as tokens are generated."""

    seq_id: int
    ns: Namespace
    tag: Tag
    request_salt: bytes
    tokens: list[int]
    prompt_len: int
    blocks: list[Block]
    hashes: list[bytes]
    num_cached_tokens: int  # prefix whose prefill was skipped
    lookup_hit_tokens: int  # what the index held (may exceed num_cached_tokens by the last-token rule)
    num_computed: int = 0  # tokens whose KV is written into the pages
    num_registered: int = 0  # leading blocks already in the index (hit or committed)
    flush_gen: int = 0
    use_cache: bool = True
    released: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def block_table(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class CacheEngine(Tier):
    """L1 tier over one page tensor. ``num_blocks`` is fixed at construction (allocated once)."""

    name = "l1"

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        metrics: CacheMetrics | None = None,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(num_blocks, layout.block_size)
        self.pages = KVPages(layout, num_blocks, torch.device(device))
        self.metrics = metrics or CacheMetrics()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        # block_id -> (hash, tag). An entry is valid only while the block still holds that hash: the
        # pool evicts on its own (allocation, caps), so stale entries are ignored, never trusted.
        self._tags: dict[int, tuple[bytes, Tag]] = {}
        self._retired: set[tuple[str, str]] = set()  # (model, revision) that may neither hit nor store
        self._flush_gen = 0
        self._running: dict[int, CachedSequence] = {}
        # Blocks held by each owner's running requests, and per-owner limits on them (in blocks).
        self._inflight: dict[str, int] = {}
        self._inflight_limits: dict[str, int] = {}
        self.default_inflight_blocks = max(1, num_blocks // 2)

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
    ) -> CachedSequence:
        """Find the longest usable exact-prefix hit, hold it, and allocate blocks for the rest of the
        prompt plus ``max_new_tokens``. The last prompt token is never served from cache (its logits
        are needed), so the hit is at most ``len(tokens) - 1`` rounded down to a block boundary;
        ``recompute_last=False`` lifts that rule for callers that only move KV (``store``).
        Raises ``OutOfBlocks`` (nothing held) when the pool cannot fit the request now without evicting
        another owner's protected share, and ``InflightLimit`` when ``owner``'s running requests already
        hold its in-flight limit (a request is always admitted when the owner holds nothing, so one
        request up to the context length always fits)."""
        tokens = list(tokens)
        if not tokens:
            raise InvalidPrompt("prompt is empty")
        bs = self.block_size
        tag = Tag(owner, model, revision, ns.digest)
        use_cache = use_cache and (model, revision) not in self._retired
        hashes = chain_hashes(ns, tokens, bs, request_salt=request_salt) if use_cache else []
        with self._lock:
            index_hits: list[Block] = []
            if use_cache:
                for i, h in enumerate(hashes):
                    block = self.pool.get_cached(h, tuple(tokens[i * bs : (i + 1) * bs]))
                    if block is None:
                        break
                    index_hits.append(block)
            usable = index_hits[: (len(tokens) - int(recompute_last)) // bs]
            total = -(-(len(tokens) + max_new_tokens) // bs)
            held = self._inflight.get(owner, 0)
            if held and held + total > self.inflight_limit(owner):
                raise InflightLimit("this tenant has too many tokens in flight; retry when a request finishes")
            self.pool.touch(usable)
            try:
                fresh = self.pool.allocate(total - len(usable), owner)
            except Exception:
                self.pool.free(usable)
                raise
            hit_tokens = len(usable) * bs
            seq = CachedSequence(
                seq_id=next(self._ids),
                ns=ns,
                tag=tag,
                request_salt=request_salt,
                tokens=tokens,
                prompt_len=len(tokens),
                blocks=usable + fresh,
                hashes=hashes,
                num_cached_tokens=hit_tokens,
                lookup_hit_tokens=len(index_hits) * bs,
                num_computed=hit_tokens,
                num_registered=len(usable),
                flush_gen=self._flush_gen,
                use_cache=use_cache,
            )
            self._running[seq.seq_id] = seq
            self._inflight[owner] = held + len(seq.blocks)
            self.metrics.record_query(
                tenant=owner,
                model=model,
                query_tokens=len(tokens),
                lookup_hit_tokens=seq.lookup_hit_tokens,
                load_success_tokens=hit_tokens,
                effective_hit_tokens=hit_tokens,
            )
            if hit_tokens:
                self.metrics.observe_load("l1", tokens=hit_tokens, nbytes=0, seconds=0.0)
            return seq

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
        before a flush, or of a retired revision, registers nothing (the flush must stay flushed)."""
        bs = self.block_size
        with self._lock:
            full = seq.num_computed // bs
            if (
                not seq.use_cache
                or seq.flush_gen != self._flush_gen
                or (seq.tag.model, seq.tag.revision) in self._retired
                or full <= seq.num_registered
            ):
                return 0
            if len(seq.hashes) < full:
                start = len(seq.hashes)
                seq.hashes += chain_hashes(
                    seq.ns,
                    seq.tokens[start * bs : full * bs],
                    bs,
                    request_salt=seq.request_salt,
                    parent=seq.hashes[-1] if seq.hashes else None,
                )
            new = 0
            for i in range(seq.num_registered, full):
                block = seq.blocks[i]
                kept = self.pool.cache(block, seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]), seq.tag.owner)
                if kept is block and block.block_hash is not None:
                    self._tags[block.block_id] = (block.block_hash, seq.tag)
                    new += 1
            seq.num_registered = full
            self.metrics.usage(seq.tag.owner, seq.tag.model).stored_tokens += new * bs
            return new

    def release(self, seq: CachedSequence) -> None:
        """Commit what is computed, then free the request's blocks. Idempotent."""
        with self._lock:
            if seq.released:
                return
            self.commit(seq)
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

    def abort(self, seq: CachedSequence) -> None:
        """Free without registering anything (the request failed; its KV may be partial)."""
        with self._lock:
            if seq.released:
                return
            self._finish(seq)

    # ------------------------------------------------------------------ tier contract (KV API, tiers)
    def _hit_blocks(self, ns: Namespace, tokens: Sequence[int], request_salt: bytes, *, hold: bool) -> list[Block]:
        """The contiguous hit prefix of ``tokens``. Hashes are computed outside the lock, a batch of
        blocks at a time, and hashing stops at the first miss, so a long token list neither stalls
        other requests nor costs more than its hit. ``hold``: take a reference on each hit (the caller
        frees them)."""
        bs = self.block_size
        hits: list[Block] = []
        parent = None
        try:
            for start in range(0, len(tokens) - bs + 1, bs * _HASH_BATCH):
                part = tokens[start : start + bs * _HASH_BATCH]
                hashes = chain_hashes(ns, part, bs, request_salt=request_salt, parent=parent)
                with self._lock:
                    for i, h in enumerate(hashes):
                        block = self.pool.get_cached(h, tuple(part[i * bs : (i + 1) * bs]))
                        if block is None:
                            return hits
                        if hold:
                            self.pool.touch([block])
                        hits.append(block)
                parent = hashes[-1]
        except BaseException:
            if hold and hits:
                with self._lock:
                    self.pool.free(hits)
            raise
        return hits

    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        return len(self._hit_blocks(ns, list(tokens), request_salt, hold=False)) * self.block_size

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
            have = seq.num_cached_tokens // self.block_size
            todo = [b.block_id for b in seq.blocks[have:n_blocks]]
            if todo:
                self.pages.write_blocks(_ids(todo), kv[have:n_blocks].to(self.pages.device))
            self.mark_computed(seq, n_blocks * self.block_size)
            return self.commit(seq)
        finally:
            self.release(seq)

    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        tokens = list(tokens)
        t0 = time.perf_counter()
        hits = self._hit_blocks(ns, tokens, request_salt, hold=True)
        try:
            kv = self.pages.read_blocks(_ids([b.block_id for b in hits])) if hits else torch.empty(
                (0, *self.layout.page_shape), dtype=self.layout.torch_dtype
            )
        finally:
            with self._lock:
                self.pool.free(hits)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[: len(hits) * self.block_size] = True
        with self._lock:
            self.metrics.observe_load(
                "l1", tokens=len(hits) * self.block_size, nbytes=kv.numel() * kv.element_size(),
                seconds=time.perf_counter() - t0,
            )
        return Retrieved(kv, mask)

    # ------------------------------------------------------------------ operations
    def flush(self, match: Callable[[Tag], bool]) -> dict[str, int]:
        """Drop every cached block whose tag matches from the index. Held blocks stay usable by their
        running request but can never be hit again; requests admitted before the flush register nothing.
        Returns ``{"blocks_freed", "tokens_dropped"}``."""
        with self._lock:
            self._flush_gen += 1
            dropped = self.pool.drop_where(lambda b: (tag := self.tag_of(b)) is not None and match(tag))
            for block_id in [i for i, (h, _) in self._tags.items() if self.pool.blocks[i].block_hash != h]:
                del self._tags[block_id]
            self.metrics.flushed_blocks += dropped
            return {"blocks_freed": dropped, "tokens_dropped": dropped * self.block_size}

    def tag_of(self, block: Block) -> Tag | None:
        """The tag of a cached block, or None if the block no longer holds what was tagged."""
        entry = self._tags.get(block.block_id)
        return entry[1] if entry is not None and entry[0] == block.block_hash else None

    def count_cached(self, match: Callable[[Tag], bool]) -> int:
        """Cached (indexed) blocks whose tag matches: 0 after a flush of ``match`` (the probe)."""
        with self._lock:
            return sum(1 for b in self.pool.blocks if b.block_hash is not None and (t := self.tag_of(b)) and match(t))

    def retire(self, model: str, revision: str) -> dict[str, int]:
        """Stop admitting hits for (model, revision) and drop its blocks (weight-revision rollout)."""
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
            self.pool.check_integrity()
            held: dict[str, int] = {}
            for seq in self._running.values():
                held[seq.tag.owner] = held.get(seq.tag.owner, 0) + len(seq.blocks)
            assert held == self._inflight, f"in-flight blocks {self._inflight} != running requests {held}"
            for block in self.pool.blocks:
                if block.block_hash is not None:
                    assert self.tag_of(block) is not None, f"cached block {block.block_id} has no tag"

    def gauges(self) -> dict[str, int]:
        with self._lock:
            in_use = self.pool.num_in_use
            evictable = self.pool.num_cached_free
            return {
                "total": self.pool.num_blocks,
                "protected": in_use,
                "evictable": evictable,
                "free": self.pool.num_free - evictable,
                "block_size": self.block_size,
                "evictions": self.pool.stats.evictions,
                "duplicate_stores": self.pool.stats.duplicate_stores,
                "collisions": self.pool.stats.collisions,
                "cap_rejections": self.pool.stats.cap_rejections,
            }

    def snapshot(self) -> dict:
        with self._lock:
            snap = self.metrics.snapshot(self.gauges())
            snap["evictions"] = self.pool.stats.evictions
            snap["duplicate_stores"] = self.pool.stats.duplicate_stores
            return snap


_HASH_BATCH = 16  # blocks hashed per lock round trip in the KV API's lookup and retrieve


def _ids(block_ids: list[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long)
