"""Strata's L2 and L3 for one vLLM engine: the tier service that Strata's KV connector
(``workers.kv_connector``) serves from, living in vLLM's worker process beside the KV pages.

It is made of the reference engine's parts, not copies of them: L2 is a ``HostStore`` (a
``BlockPool`` with fair-share LRU among tenants, ``share_weight``, ``max_cached_tokens`` as a cap,
CRC-checked bytes), L3 the worker's ``WorkerL3`` (``RemoteStore`` over the file or Redis backend,
AES-GCM under per-tenant data keys unwrapped in memory, per-object expiry, retention sweep,
quarantine of corrupt objects, fair capacity and ``max_l3_bytes``), load versus recompute is
``LoadCost``, figures are ``CacheMetrics``, and L3 writes run on a ``Writer`` thread.

- ``stage`` (asked by the connector's scheduler side, over ``workers.kv_rpc``, before vLLM computes
  a request): the longest run of blocks after vLLM's own hit that L2 and then L3 hold for the
  request's keys, fetched and verified into a staging tensor on a loader thread, so what vLLM is
  told it may skip is exactly what arrived (a block that is missing, corrupt, undecryptable or later
  than the load deadline is a miss from it on). The call answers at once when the fetch is quick (an
  L2 copy) and otherwise ``done: False``; vLLM's scheduler then asks again at its next step
  (``stage_poll``) while it serves the other requests, so a slow L3 never stalls them. Chunks read
  from L3 are promoted into L2. Load versus recompute is ``LoadCost`` with the tiers' measured
  bandwidth and the model's prefill rate the actor measured (``TransferParams.prefill_tokens_per_s``).
- ``take`` hands the staged blocks to the worker side, which copies them into vLLM's pages.
- ``save`` (the worker side, after the forward): the full prompt blocks vLLM computed go to L2
  (write-through: vLLM's own evictions are not seen), and every L3 chunk the request completed is
  sealed and written in the background when the request may persist.
- What L2 and L3 store and drop is published as KV events (``cachecore.event_recorders``, the
  reference engine's recorders) into the service's own log, which the actor forwards into the
  replica's, so the router hears a vLLM replica's L2 and L3 too.
- Named caches (``cache_resident`` / ``cache_pin`` / ``cache_drop``, ``workers.named_caches``): the
  reference engine's soft pins and deletes (``cachecore.engine_pins``) on this service's L2 and L3.
- Flushes are fenced by the actor's flush epoch (``TransferParams.epoch``): a request sent before a
  flush that matches it neither loads nor saves after it, and an L3 write that lands during the
  flush is deleted again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import strata_env
from cachecore.engine_pins import lower_drop, lower_pin, lower_resident
from cachecore.event_recorders import L3Recorder, PoolRecorder
from cachecore.events import EventLog
from cachecore.layout import KVLayout
from cachecore.loadcost import LoadCost
from cachecore.metrics import CacheMetrics
from cachecore.tiers.base import Tag
from cachecore.tiers.host import HostStore
from cachecore.tiers.remote import l3_figures
from cachecore.writeback import Writer
from workers.config import WorkerConfig
from workers.kv_params import TransferParams
from workers.operations import l3_scope
from workers.worker_l3 import WorkerL3

MAX_L3_BACKLOG = 64  # chunks waiting for the L3 writer; past it new chunks are skipped (counted)
MAX_FLUSHES = 4096  # flush records kept for the fence; a request older than all of them is stale
STAGE_TTL_S = 300.0  # staged blocks of a request vLLM never scheduled are dropped after this
CHUNK_TOKENS = 256  # L3 object size in tokens, as on the reference engine (16 blocks of 16)
INLINE_WAIT_S = 0.005  # how long a stage call waits for its fetch before answering "not yet"
POLL_WAIT_S = 0.002  # how long a poll waits (vLLM's scheduler polls once per step)


class TierService:
    def __init__(self, cfg: WorkerConfig, layout: KVLayout, *, deployment: str, revision: str) -> None:
        self.cfg = cfg
        self.layout = layout
        self.deployment = deployment
        self.revision = revision
        self.block_size = layout.block_size
        l2_blocks = cfg.blocks(cfg.l2_mb, layout.bytes_per_block)
        self.l2 = HostStore(layout, l2_blocks, eviction_policy=cfg.eviction_policy) if l2_blocks > 0 else None
        self.l3 = WorkerL3.build(cfg, layout, chunk_blocks=max(1, CHUNK_TOKENS // layout.block_size))
        self.metrics = CacheMetrics()
        self.cost = LoadCost(cfg.load_policy)
        self.deadline_s = cfg.load_deadline_ms / 1000
        self._lock = threading.RLock()
        self._staged: dict[str, tuple[float, int, torch.Tensor, dict]] = {}
        self._pending: dict[str, Future] = {}
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="strata-vllm-load")
        self._load_delay_s = 0.0
        self._flushes: list[tuple[int, Callable[[Tag], bool]]] = []
        self._floor = 0  # requests with an epoch below this are older than every flush record kept
        self._retired: set[str] = set()
        self._writer = Writer("strata-vllm-l3-writer") if self.l3 is not None else None
        # what the tiers store and drop, as KV events; the actor forwards them into the replica's log
        self.events = EventLog(f"tiers:{deployment}:{revision}")
        if self.l2 is not None:
            self.l2.stored_listeners.append(PoolRecorder(self.events, "l2", self.l2.pool).stored)
        if self.l3 is not None:
            L3Recorder(self.events).attach(self.l3.store)
        self.counters = {"staged": 0, "stage_blocks": 0, "saved_blocks": 0, "fenced": 0, "l3_chunks": 0}

    # ------------------------------------------------------------------ per request
    def tag(self, p: TransferParams) -> Tag:
        return Tag(p.tenant, p.model, p.revision, p.ns_digest, p.persist)

    def learn(self, p: TransferParams) -> None:
        """The tenant's quotas, weight and keys, as the actor sent them with this request."""
        if p.prefill_tokens_per_s:
            self.cost.set_prefill_rate(p.prefill_tokens_per_s)
        if self.l2 is not None:
            with self._lock:
                self.l2.pool.set_weight(p.tenant, 1 if p.share_weight is None else p.share_weight)
                self.l2.pool.set_cap(p.tenant, p.max_cached_tokens)
        if self.l3 is not None:
            retention = p.tenant_retention_seconds
            self.l3.learn(p.tenant, p.data_key, p.retention_seconds if retention is None else retention)
            self.l3.store.set_tenant_limit(p.tenant, p.max_l3_bytes)
            self.l3.store.set_weight(p.tenant, p.share_weight)  # its share of L3 too, as of L2

    def _retention(self, p: TransferParams) -> float | None:
        if self.l3 is None:
            return None
        return float(p.retention_seconds) if p.retention_seconds is not None else self.l3.retention(p.tenant)

    def stale(self, p: TransferParams) -> bool:
        """Whether a flush matching the request ran after the actor sent it (or it is a retired revision's)."""
        tag = self.tag(p)
        with self._lock:
            if p.revision.split("~", 1)[0] in self._retired or p.epoch < self._floor:
                return True
            return any(e > p.epoch and match(tag) for e, match in self._flushes)

    def stage(self, req_id: str, p: TransferParams, tokens: list[int], start: int, limit: int) -> dict:
        """Start fetching blocks ``start ..`` (at most ``limit``) of the request from L2, then L3, into
        staging; ``{"done", "blocks", "l2", "l3"}`` (``blocks`` staged from ``start`` on) when the fetch
        finished within ``INLINE_WAIT_S``, else ``{"done": False}`` (ask ``stage_poll``)."""
        self._expire_staged()
        with self._lock:
            self._staged.pop(req_id, None)
            future = self._pending[req_id] = self._loader.submit(self._stage, req_id, p, tokens, start, limit,
                                                                          time.perf_counter())
        return self._answer(req_id, future, INLINE_WAIT_S)

    def stage_poll(self, req_id: str) -> dict:
        """The outcome of ``stage`` for ``req_id`` (``{"done": False}`` while it runs; a request never
        staged is done with nothing)."""
        with self._lock:
            future = self._pending.get(req_id)
        if future is None:
            return {"done": True, "blocks": 0, "l2": 0, "l3": 0}
        return self._answer(req_id, future, POLL_WAIT_S)

    def _answer(self, req_id: str, future: Future, wait_s: float) -> dict:
        try:
            out = future.result(timeout=wait_s)
        except TimeoutError:
            return {"done": False}
        except Exception:  # a store failing outright is a miss
            out = {"blocks": 0, "l2": 0, "l3": 0, "stop": "failed"}
        with self._lock:
            if self._pending.get(req_id) is future:
                del self._pending[req_id]
        return {"done": True, **out}

    def _stage(self, req_id: str, p: TransferParams, tokens: list[int], start: int, limit: int,
               t_start: float) -> dict:
        """The fetch of ``stage`` (loader thread); ``t_start``: when the request asked (the deadline's origin)."""
        if self._load_delay_s:  # test hook: a slow tier
            time.sleep(self._load_delay_s)
        self.learn(p)
        bs, bpb = self.block_size, self.layout.bytes_per_block
        # ``stop``: why the fetch stopped short (``CachedSequence.load_stop``'s words), or None
        out = {"blocks": 0, "l2": 0, "l3": 0, "stop": None}
        limit = min(limit, len(p.hashes), len(tokens) // bs)
        if start >= limit or self.stale(p):
            return out
        tag = self.tag(p)
        parts: list[torch.Tensor] = []
        covered = start
        if self.l2 is not None:
            items = []
            for i in range(start, limit):
                key, toks = p.hashes[i], tuple(tokens[i * bs:(i + 1) * bs])
                if not self.l2.contains(key, toks):
                    break
                items.append((key, toks))
            if items and self.cost.should_load("l2", nbytes=len(items) * bpb, tokens=len(items) * bs):
                t0 = time.perf_counter()
                fetched = self.l2.get(items)
                secs = time.perf_counter() - t0
                got = int(fetched.kv.shape[0])
                tier = self.metrics.tier("l2")
                if got:
                    parts.append(fetched.kv)
                    covered += got
                    out["l2"] = got
                    self.metrics.observe_load("l2", tokens=got * bs, nbytes=got * bpb, seconds=secs)
                    self.cost.observe_load("l2", nbytes=got * bpb, seconds=secs, blocks=got)
                    tier.promotions += got
                if fetched.stopped == "corrupt":
                    tier.corrupt_loads += 1
                    tier.fallbacks_to_recompute += 1
                    out["stop"] = "corrupt"
            elif items:
                self.metrics.tier("l2").fallbacks_to_recompute += 1
                out["stop"] = "recompute"
        if self.l3 is not None and p.persist and covered < limit and time.perf_counter() - t_start < self.deadline_s:
            got = self._stage_l3(p, tag, tokens, covered, limit, parts, t_start, out)
            covered += got
            out["l3"] = got
        out["blocks"] = covered - start
        if out["blocks"]:
            kv = torch.cat(parts) if len(parts) > 1 else parts[0]
            with self._lock:
                self._staged[req_id] = (time.monotonic(), start, kv, out)
            self.counters["staged"] += 1
            self.counters["stage_blocks"] += out["blocks"]
        return out

    def _stage_l3(self, p: TransferParams, tag: Tag, tokens: list[int], covered: int, limit: int,
                  parts: list[torch.Tensor], t_start: float, out: dict) -> int:
        store = self.l3.store
        bs, bpb, cb = self.block_size, self.layout.bytes_per_block, store.chunk_blocks
        c0 = covered // cb * cb
        t0 = time.perf_counter()
        found = store.probe(p.hashes[c0:], tag)
        end = min(c0 + found, limit)
        if end <= covered:
            return 0
        tier = self.metrics.tier("l3")
        if not self.cost.should_load("l3", nbytes=(end - covered) * bpb, tokens=(end - covered) * bs):
            tier.fallbacks_to_recompute += 1
            out["stop"] = "recompute"
            return 0
        fetched = store.get(p.hashes, tokens, tag, end, first_block=covered, retention_seconds=self._retention(p))
        secs = time.perf_counter() - t0
        got = int(fetched.kv.shape[0])
        if fetched.stopped not in (None, "miss"):
            out["stop"] = fetched.stopped
        if fetched.stopped == "corrupt":
            tier.corrupt_loads += 1
            tier.fallbacks_to_recompute += 1
        if time.perf_counter() - t_start > self.deadline_s:  # arrived, but too late to count on: recomputed
            tier.late_loads += 1
            out["stop"] = "late"
            return 0
        if not got:
            return 0
        parts.append(fetched.kv)
        self.metrics.observe_load("l3", tokens=got * bs, nbytes=got * bpb, seconds=secs)
        self.cost.observe_load("l3", nbytes=got * bpb, seconds=secs, blocks=got)
        tier.promotions += got
        if self.l2 is not None:  # chunks read from L3 land in L2 too (promotion)
            rows = range(covered, covered + got)
            stored = self.l2.put_many([(p.hashes[i], tuple(tokens[i * bs:(i + 1) * bs]), tag) for i in rows],
                                      fetched.kv)
            self.metrics.tier("l2").bytes_in += stored * bpb
        return got

    def take(self, req_id: str) -> tuple[int, torch.Tensor] | None:
        """The staged blocks of ``req_id`` (first block index, ``[n, *page_shape]``), handed over once."""
        with self._lock:
            entry = self._staged.pop(req_id, None)
        return None if entry is None else (entry[1], entry[2])

    def staged(self, req_id: str) -> dict | None:
        with self._lock:
            entry = self._staged.get(req_id)
        return None if entry is None else {"start": entry[1], **entry[3]}

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._staged.pop(req_id, None)
            self._pending.pop(req_id, None)

    def _expire_staged(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, e in self._staged.items() if now - e[0] > STAGE_TTL_S]:
                del self._staged[rid]

    def save(self, p: TransferParams, tokens: list[int], first: int, kv: torch.Tensor) -> int:
        """Blocks ``first .. first + len(kv) - 1`` of the request, as vLLM computed them, into L2;
        how many were new. Nothing when a flush matching the request ran since it was sent."""
        if self.l2 is None or not len(kv):
            return 0
        bs = self.block_size
        tag = self.tag(p)
        entries = [(p.hashes[i], tuple(tokens[i * bs:(i + 1) * bs]), tag) for i in range(first, first + len(kv))]
        with self._lock:  # a flush cannot run between the fence check and the put
            if self.stale(p):
                self.counters["fenced"] += 1
                return 0
            stored = self.l2.put_many(entries, kv)
        tier = self.metrics.tier("l2")
        tier.demotions += stored
        tier.bytes_in += stored * self.layout.bytes_per_block
        self.counters["saved_blocks"] += stored
        return stored

    def write_chunk(self, p: TransferParams, tokens: list[int], chunk: int, kv: torch.Tensor) -> bool:
        """Queue L3 chunk ``chunk`` of the request (``kv``: its ``chunk_blocks`` blocks) for sealing and
        writing; False when L3 is off, the request may not persist, or the writer is behind."""
        if self.l3 is None or not p.persist:
            return False
        store = self.l3.store
        if self._writer.backlog() >= MAX_L3_BACKLOG:
            self.metrics.tier("l3").skipped_writes += 1
            return False
        cb, bs = store.chunk_blocks, self.block_size
        hashes = p.hashes[chunk * cb:(chunk + 1) * cb]
        toks = tokens[chunk * cb * bs:(chunk + 1) * cb * bs]
        tag, retention = self.tag(p), self._retention(p)

        def job() -> None:
            if self.stale(p):
                return
            if store.put_chunk(hashes, toks, tag, kv, retention_seconds=retention):
                tier = self.metrics.tier("l3")
                tier.demotions += cb
                tier.bytes_in += cb * self.layout.bytes_per_block
                self.counters["l3_chunks"] += 1
                if self.stale(p):  # a flush ran while this chunk was being written: it stays flushed
                    store.delete_chunk(tag, hashes[-1])

        self._writer.submit(job)
        return True

    def writing(self) -> bool:
        """Whether L3 chunks are being sealed and written (fsynced, on the file backend) right now."""
        return self._writer is not None and self._writer.busy()

    def chunk_blocks(self) -> int:
        return self.l3.store.chunk_blocks if self.l3 is not None else 0

    # ------------------------------------------------------------------ KV API (workers.vllm_kv_api)
    def kv_lookup(self, hashes: list[bytes], tokens: list[int]) -> int:
        """Leading blocks of ``hashes`` held in L2 (index only)."""
        if self.l2 is None:
            return 0
        bs, n = self.block_size, 0
        for i, key in enumerate(hashes):
            if not self.l2.contains(key, tuple(tokens[i * bs:(i + 1) * bs])):
                break
            n += 1
        return n

    def kv_retrieve(self, hashes: list[bytes], tokens: list[int]) -> dict:
        """The L2 blocks of ``hashes`` (the contiguous part that arrives and verifies), as raw bytes."""
        from workers.kv_wire import to_wire

        bs = self.block_size
        items = [(key, tuple(tokens[i * bs:(i + 1) * bs])) for i, key in enumerate(hashes)]
        t0 = time.perf_counter()
        fetched = self.l2.get(items) if self.l2 is not None and items else None
        kv = fetched.kv if fetched is not None else torch.empty((0, *self.layout.page_shape),
                                                                dtype=self.layout.torch_dtype)
        if len(kv):
            self.metrics.observe_load("l2", tokens=len(kv) * bs, nbytes=len(kv) * self.layout.bytes_per_block,
                                      seconds=time.perf_counter() - t0)
        return to_wire(kv)

    def kv_store(self, *, tenant: str, model: str, revision: str, ns_digest: bytes, hashes: list[bytes],
                 tokens: list[int], kv: dict, share_weight: int | None, max_cached_tokens: int | None) -> int:
        """Uploaded blocks (checked by the caller) into L2 under their own keys, never persisted."""
        from workers.kv_wire import from_wire

        if self.l2 is None:
            return 0
        blocks = from_wire(kv)
        bs = self.block_size
        tag = Tag(tenant, model, revision, ns_digest, False)
        with self._lock:
            self.l2.pool.set_weight(tenant, 1 if share_weight is None else share_weight)
            self.l2.pool.set_cap(tenant, max_cached_tokens)
            if revision in self._retired:
                return 0
            return self.l2.put_many([(h, tuple(tokens[i * bs:(i + 1) * bs]), tag) for i, h in enumerate(hashes)],
                                    blocks[:len(hashes)])

    def slow_loads(self, seconds: float) -> None:
        """Test hook (``STRATA_TEST_HOOKS``): every fetch takes ``seconds`` longer (a slow tier)."""
        if not strata_env.enabled_test_hooks():
            raise PermissionError("test hooks are disabled")
        self._load_delay_s = float(seconds)

    def corrupt_l2(self, hashes: list[bytes]) -> int:
        """Test hook (``STRATA_TEST_HOOKS``): flip bytes of these L2 blocks (their CRC then fails)."""
        if not strata_env.enabled_test_hooks() or self.l2 is None:
            raise PermissionError("test hooks are disabled")
        return sum(self.l2.corrupt(h) for h in hashes)

    # ------------------------------------------------------------------ named caches (workers.named_caches)
    def _l3_store(self):
        return self.l3.store if self.l3 is not None else None

    def _named(self, params: dict) -> tuple[TransferParams, Tag]:
        p = TransferParams.from_wire(params)
        if p is None:
            raise ValueError("malformed transfer params")
        self.learn(p)  # the tenant's data keys (L3 probes need them), weight and cap
        return p, self.tag(p)

    def cache_resident(self, params: dict, tokens: list[int]) -> dict:
        """Tokens of the request's full-block prefix held in L2 and L3: ``{"l2", "l3"}``."""
        p, tag = self._named(params)
        return lower_resident(self.l2, self._l3_store(), p.hashes, tokens, tag, self.block_size)

    def cache_pin(self, params: dict, tokens: list[int], until: float | None) -> dict:
        """Soft-pin the request's blocks in L2 and its chunks in L3 until ``until`` (None: unpin);
        returns ``cache_resident``."""
        p, tag = self._named(params)
        lower_pin(self.l2, self._l3_store(), p.hashes, until)
        return lower_resident(self.l2, self._l3_store(), p.hashes, tokens, tag, self.block_size)

    def cache_drop(self, params: dict, tokens: list[int]) -> dict:
        """Delete the request's blocks from L2 and the L3 objects covering them, with their pins
        (queued L3 writes land first): ``{"l2": blocks, "l3": objects, "bytes"}``."""
        p, tag = self._named(params)
        self.drain()
        with self._lock:
            n2 = self.l2.drop_keys(list(p.hashes)) if self.l2 is not None else 0
            self.metrics.flushed_blocks += n2
        done = lower_drop(None, self._l3_store(), p.hashes, tag)
        return {"l2": n2, "l3": done["l3"], "bytes": n2 * self.layout.bytes_per_block + done["l3_bytes"]}

    # ------------------------------------------------------------------ jobs
    def flush(self, scope: dict, epoch: int) -> dict:
        """``ServingEngine.flush`` for the tiers: drop L2 blocks and L3 objects of ``scope`` (as the
        reference worker's ``operations.flush``); requests sent before ``epoch`` matching it are
        fenced from then on."""
        kind = scope.get("scope")
        match = _matcher(scope)
        n2 = n3 = b3 = 0
        if match is not None:
            with self._lock:
                self._flushes.append((int(epoch), match))
                if len(self._flushes) > MAX_FLUSHES:
                    self._floor = self._flushes.pop(0)[0]
                n2 = self.l2.delete(match) if self.l2 is not None else 0
                self.metrics.flushed_blocks += n2
        if self.l3 is not None:
            if kind == "l3_expire":
                n3, b3 = self.l3.expire(str(scope["tenant"]), int(scope["retention_seconds"]))
            elif kind == "adapter":  # every tenant's objects of the adapter under this revision
                self._writer.drain()
                n3, b3 = self.l3.store.delete_scope(model=self.deployment, revision=self._adapter_tag(scope))
            else:
                self._writer.drain()  # writes queued before the flush land first (and skip themselves)
                n3, b3 = self.l3.store.delete_scope(**l3_scope(scope, self.deployment),
                                                    revision_variants=kind == "revision")  # its adapters' too
        return {"l2": n2, "l3": n3, "l3_bytes": b3}

    def probe(self, scope: dict) -> int:
        kind = scope.get("scope")
        match = _matcher(scope)
        n = self.l2.count(match) if self.l2 is not None and match is not None else 0
        if self.l3 is not None:
            if kind == "l3_expire":
                n += self.l3.store.count_expired(tenant=str(scope["tenant"]),
                                                 retention_seconds=int(scope["retention_seconds"]))
            elif kind == "adapter":
                n += self.l3.store.count_scope(model=self.deployment, revision=self._adapter_tag(scope))[0]
            else:
                n += self.l3.store.count_scope(**l3_scope(scope, self.deployment),
                                               revision_variants=kind == "revision")[0]
        return n

    def _adapter_tag(self, scope: dict) -> str:
        """The revision tag of an adapter's KV on this service (``workers.vllm_worker.tag_revision``)."""
        return f"{self.revision}~{scope['adapter']}"

    def retire(self, revision: str) -> dict:
        """A rollout replaced ``revision``: it may neither load nor save again; its blocks go."""
        with self._lock:
            self._retired.add(revision)
        return self.flush({"scope": "revision", "revision": revision}, epoch=0)

    def drop_data_key(self, tenant: str, version: int) -> dict:
        if self.l3 is None:
            return {"objects": 0, "bytes": 0}
        return self.l3.drop(tenant, version)

    def drain(self) -> None:
        if self._writer is not None:
            self._writer.drain()

    def events_since(self, since_seq: int) -> dict:
        """``EventLog.page`` of the tiers' KV events (``workers.vllm_worker`` forwards them)."""
        return self.events.page(since_seq)

    def events_snapshot(self) -> dict:
        return self.events.snapshot()

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        resident: dict[str, dict] = {}
        info = {"l2_blocks": 0, "l3_chunk_blocks": self.chunk_blocks(), "counters": dict(self.counters)}
        if self.l2 is not None:
            g = self.l2.gauges()
            snap["tiers"].setdefault("l2", self.metrics.tier_row("l2")).update(
                capacity_blocks=g["total"], used_blocks=g["used"], evictions=g["evictions"],
                rejected_puts=g["rejected"])
            resident["l2"] = self.l2.resident()
            info["l2_blocks"] = g["total"]
        if self.l3 is not None:
            store = self.l3.store
            scope = (self.deployment, self.revision)  # the store is shared: count this revision's objects
            row = snap["tiers"].setdefault("l3", self.metrics.tier_row("l3"))
            row.update(l3_figures(store.gauges(scope), store.chunk_blocks, self.layout.bytes_per_block))
            bpb = self.layout.bytes_per_block
            resident["l3"] = {t: b // bpb for t, b in store.usage_by_tenant(scope=scope).items()}
        snap["resident_blocks"] = resident
        snap["service"] = info
        snap["load_cost"] = self.cost.snapshot()
        return snap

    def check_integrity(self) -> bool:
        if self.l2 is not None:
            self.l2.check_integrity()
        if self.l3 is not None:
            self.l3.store.check_integrity()
        return True

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self.l3 is not None:
            self.drain()
            self.l3.close()


def _matcher(scope: dict) -> Callable[[Tag], bool] | None:
    """The L2 blocks a flush scope selects (None: the scope is L3's only)."""
    kind = scope.get("scope")
    if kind == "tenant":
        tenant = str(scope["tenant"])
        return lambda t: t.owner == tenant
    if kind == "revision":  # an adapter's blocks of the revision too (tagged ``<label>~<adapter>``)
        label = scope["revision"]
        return lambda t: t.revision.split("~", 1)[0] == label
    if kind == "adapter":
        suffix = "~" + scope["adapter"]
        return lambda t: t.revision.endswith(suffix)
    if kind in ("model", "all"):
        return lambda t: True
    if kind in ("key_version", "tenant_l3", "l3_expire"):
        return None
    raise ValueError(f"unknown flush scope {kind!r}")
