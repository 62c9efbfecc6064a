"""The engine's lower-tier reads: the prefix after the L1 hit, loaded from L2 and L3 into the
request's fresh L1 pages (promotion), with a deadline; part of :class:`cachecore.engine.CacheEngine`.

``admit`` starts ``_load`` on a loader thread at once (prefetch); ``finish_loads`` waits for it up to
the deadline. L3 is probed, decided (load vs recompute with its own measured bandwidth) and fetched
on the loader thread, never under the engine's lock. A block that did not arrive, arrived late or
failed its check is a miss for it and every block after it.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from cachecore.sequence import CachedSequence


class LoadsMixin:
    """Mixed into ``CacheEngine``; uses its lock, stores, metrics and cost model."""

    def _load(self, seq: CachedSequence, l2_items: list, start: int, limit: int, try_l3: bool) -> dict:
        """Loader thread: the lower-tier prefix of ``seq`` from block ``start``: the L2 items, then
        L3 chunks after them (probed, decided and fetched here, off the engine's lock). Returns the
        KV rows in order and what each tier delivered; never raises for a tier's state."""
        bs, bpb = self.block_size, self.layout.bytes_per_block
        out: dict = {"parts": [], "l2": 0, "l3": 0, "l2_stop": None, "l3_stop": None, "l2_s": 0.0, "l3_s": 0.0,
                     "l3_lookup": 0}
        if l2_items:
            t0 = time.perf_counter()
            fetched = self.l2.get(l2_items)
            out["l2_s"] = time.perf_counter() - t0
            out["l2"], out["l2_stop"] = int(fetched.kv.shape[0]), fetched.stopped
            if out["l2"]:
                out["parts"].append(fetched.kv)
            if out["l2"] < len(l2_items):
                return out
        if not try_l3:
            return out
        covered = start + out["l2"]
        cb = self.l3.chunk_blocks
        c0 = covered // cb * cb
        t0 = time.perf_counter()
        found = self.l3.probe(seq.hashes[c0:], seq.tag)
        end = min(c0 + found, limit)
        out["l3_lookup"] = max(0, c0 + found - covered)
        if end > covered and self.cost.should_load("l3", nbytes=(end - covered) * bpb, tokens=(end - covered) * bs):
            fetched = self.l3.get(seq.hashes, seq.tokens, seq.tag, end, first_block=covered,
                                  retention_seconds=seq.retention_seconds)
            out["l3"], out["l3_stop"] = int(fetched.kv.shape[0]), fetched.stopped
            if out["l3"]:
                out["parts"].append(fetched.kv)
        elif end > covered:
            out["l3_stop"] = "recompute"
        out["l3_s"] = time.perf_counter() - t0
        return out

    def finish_loads(self, seq: CachedSequence) -> int:
        """Wait (up to the load deadline) for the lower-tier prefix started by ``admit`` and copy it
        into the request's pages; a block that did not arrive in time, failed or was corrupt is a miss
        for it and every block after it (recomputed). Returns the final ``num_cached_tokens``.
        Idempotent."""
        future, seq.pending = seq.pending, None
        if future is None:
            return seq.num_cached_tokens
        bs, bpb = self.block_size, self.layout.bytes_per_block
        waited = self.config.load_deadline_s - (time.perf_counter() - seq.load_started)
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
            self.l1.write(seq.load_blocks[:n], kv[:n])
            if n3 and self.l2 is not None:  # chunks loaded from L3 land in L2 too (promotion)
                first = seq.num_registered + n2
                rows = range(first, first + min(n3, n - n2))
                bs = self.block_size
                stored = self.l2.put_many(
                    [(seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]), seq.tag) for i in rows],
                    kv[n2 : n2 + len(rows)])
                with self._lock:
                    self.metrics.tier("l2").bytes_in += stored * self.layout.bytes_per_block
        with self._lock:
            for name, got, secs, stop in (("l2", n2, result["l2_s"] if result else 0.0, result and result["l2_stop"]),
                                          ("l3", n3, result["l3_s"] if result else 0.0, result and result["l3_stop"])):
                tier = self.metrics.tier(name)
                if got:
                    self.metrics.observe_load(name, tokens=got * bs, nbytes=got * bpb, seconds=secs)
                    self.cost.observe_load(name, nbytes=got * bpb, seconds=secs, blocks=got)
                    tier.promotions += got
                    self.metrics.promotions += got
                if stop == "corrupt":
                    tier.corrupt_loads += 1
                    tier.fallbacks_to_recompute += 1
                elif stop == "recompute":
                    tier.fallbacks_to_recompute += 1
            if result is None:
                tier = self.metrics.tier("l3" if self.l2 is None else "l2")
                tier.failures += 1
                tier.fallbacks_to_recompute += 1
            if result:
                seq.lookup_hit_tokens += result["l3_lookup"] * bs
            seq.num_cached_tokens += n * bs
            seq.num_computed = seq.num_cached_tokens
            if n and not self._stale(seq):
                promoted = []
                with self.pool.batch():
                    for i in range(seq.num_registered, seq.num_registered + n):
                        block = seq.blocks[i]
                        kept = self.pool.cache(block, seq.hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs]),
                                               seq.tag.owner, seq.tag)
                        if kept is block and block.block_hash is not None:
                            promoted.append(block.block_hash)
                    if promoted and self._l1_events is not None:
                        self._l1_events.stored(promoted)
                seq.num_registered += n
            if n3 and self.l3 is not None:  # the chunks it loaded from L3 are there already
                seq.l3_chunks = seq.num_registered // self.l3.chunk_blocks
            seq.load_blocks = []
            self._record_query(seq)
        return seq.num_cached_tokens

    def _late_arrival(self, seq: CachedSequence, future) -> None:
        try:
            result = future.result()
            n = result["l2"] + result["l3"]
        except Exception:
            return
        with self._lock:
            self.metrics.usage(seq.tag.owner, seq.tag.model).load_success_tokens += n * self.block_size
            self.metrics.tier("l2").late_loads += 1
