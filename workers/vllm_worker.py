"""VllmWorker: a replica that serves through vLLM's async engine, behind the same contract as
``CacheWorker`` (``workers.engine_contract``), in the same Ray actor.

What Strata keeps in front of vLLM, so that a tenant sees the same platform whichever engine serves:

- **Scope.** Every request's ``cache_salt`` is derived here from what the server sent
  (``VllmRevision.cache_salt``: the scope salt through the namespace, the scope's flush generation,
  the client's ``cache_salt`` as a narrowing salt). vLLM's prefix cache never shares across scopes.
- **Admission.** The tenant's concurrent-request slots and cancellation are the reference worker's
  (``workers.admission``); its in-flight tokens (prompt + ``max_tokens`` of its running requests)
  are bounded by ``max_inflight_tokens`` (default: half of vLLM's cache; whole blocks; one request
  may exceed it alone, as on the reference engine); ``FairGate`` keeps at most ``STRATA_MAX_BATCH``
  requests inside vLLM and admits the rest by start-time fair queuing weighted by ``share_weight``.
- **Streams.** vLLM's outputs become ``workers.protocol`` events; the text of each token and
  ``stop`` are applied by ``workers.stops`` with the revision's tokenizer (as on the reference
  engine); ``cached_tokens`` is vLLM's ``num_cached_tokens``. A closed, cancelled or retired stream
  is aborted in vLLM.
- **Jobs.** A flush bumps the flush generation of the scope, so the scope's next requests carry a
  new ``cache_salt`` and can never reach a block computed before; for a model, a revision or
  everything it also resets vLLM's prefix cache. A rollout starts a second vLLM engine on the new
  revision (``stage_revision``), switches new requests to it, drains the old one's requests until
  the deadline (the rest end with a retryable ``revision_changed``) and shuts the old engine down.
- **Tiers.** Behind vLLM's device cache, Strata's KV connector (``workers.kv_connector``) serves
  each request from Strata's L2 and encrypted L3 (``workers.kv_tiers``, in vLLM's worker process):
  the actor computes the request's Strata block keys from its scope and hands them, with the
  tenant's quotas, weight, data keys and L3 policy, to the connector as ``kv_transfer_params``
  (``workers.kv_params``); jobs and figures reach the tier service over ``workers.kv_rpc``.
  ``STRATA_VLLM_CONNECTOR=0`` (or tensor parallelism) leaves vLLM's device cache alone.
- **Routing and figures.** The Strata block hashes of what vLLM computed are recorded
  (``workers.vllm_blocks``) and published as KV events (tier ``l1``); per-tenant prompt and cached
  tokens go into the same ``CacheMetrics`` as the reference engine's, the tiers' figures come from
  the tier service. The router's section (``workers.router_stats``) counts L1 and L2 as the
  reference engine's does: ``capacity_tokens`` is the blocks vLLM allocated plus L2's.

- **LoRA adapters.** A request with ``lora`` (``WorkerRequest.lora``) runs with vLLM's
  ``LoRARequest(name, id, path)`` (the engine loads an adapter on first use and evicts LRU; several in
  one batch) on an engine started with ``enable_lora`` (``VllmRevision.lora``). The adapter's scope is
  the namespace's ``lora_id`` in every key: vLLM's ``cache_salt``, Strata's block keys (L2, L3, KV
  events, the router's hashes) and its tag ``<revision>~<scope>`` in L2 and L3 (``tag_revision``),
  which an ``adapter`` flush deletes. Its files are checked against the registered digest before the
  first request that uses them (a changed directory is refused, never served under the old scope).

- **Named caches** (``workers.named_caches``): prewarm, soft pins and drops of a prompt's blocks in
  Strata's L2 and L3 (vLLM's device cache cannot be edited per block from outside).
- **KV API** (``workers.vllm_kv_api``): layout, lookup, retrieve and uploads over the tier service's
  L2, as on the reference engine; ``kv_api_unsupported`` without the connector.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace

import strata_env
from cachecore.errors import (
    AdapterUnsupported,
    BackendUnavailable,
    CacheError,
    InflightLimit,
    InvalidPrompt,
    PromptTooLong,
)
from cachecore.events import AllCleared, BlockStored, EventBatch, EventLog
from cachecore.hashing import chain_hashes
from cachecore.loadcost import PRIORS
from cachecore.metrics import CacheMetrics
from cachecore.routing.hashes import request_salt
from workers.admission import CANCEL_TENANT_WAIT_S, MAX_CONCURRENCY, RequestSlots
from workers.async_loop import AsyncLoop
from workers.config import WorkerConfig
from workers.fair_gate import FairGate
from workers.kv_params import KEY, TransferParams
from workers.kv_rpc import TierCallError
from workers.kv_tiers import CHUNK_TOKENS
from workers.kv_wire import from_wire, retrieved_wire
from workers.named_caches import VllmNamedCaches
from workers.protocol import (
    WorkerRequest,
    error_event,
    finished_event,
    prefilled_event,
    token_event,
)
from workers.router_stats import DEFAULT_DECODE_STEP_S, DEFAULT_PREFILL_TOKENS_PER_S, L1_TOKENS_PER_S, DecodeClock
from workers.vllm_blocks import DerivedBlocks
from workers.vllm_kv_api import VllmKVApi
from workers.vllm_revision import VllmRevision

logger = logging.getLogger("strata.vllm")
RETRYABLE = frozenset({"revision_changed", "inflight_limit", "tenant_busy", "engine_busy", "request_stopped"})
START_TIMEOUT_S = 900.0  # a vLLM engine start (weights, compile) on a slow CPU
_END = object()
_POLL_S = 0.05  # how often a waiting stream checks for cancellation
_SCOPE_MEMORY = 4096  # flushed scopes whose generation is kept; past it every scope moves on at once
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def lora_id(req: WorkerRequest) -> str:
    """The namespace's ``lora_id`` of a request: its adapter's scope (``""``: the base model)."""
    return req.lora["scope"] if req.lora else ""


def tag_revision(label: str, req: WorkerRequest) -> str:
    """The revision its KV is tagged with in L1 records, L2 and L3: the revision's label, with
    ``~<adapter scope>`` for an adapter's (so an ``adapter`` flush finds exactly its blocks)."""
    return f"{label}~{req.lora['scope']}" if req.lora else label


def label_of(tag: str) -> str:
    """The revision label of a ``tag_revision``."""
    return tag.split("~", 1)[0]


class RevisionChanged(CacheError):
    code = "revision_changed"


@dataclass
class _Running:
    tenant: str
    revision: str
    prompt_tokens: int
    held_tokens: int  # prompt + max_tokens: what counts against max_inflight_tokens
    prefilled: bool = False


def _device() -> str:
    forced = strata_env.device()
    if forced and forced.lower() != "auto":  # "auto": as cachecore.device reads it (was: CPU here)
        return "cuda" if forced.startswith("cuda") else "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover - torch is a dependency
        return "cpu"


class VllmWorker:
    """One model deployment served by vLLM (module docstring). Same constructor as ``CacheWorker``
    (``preset``, ``l2_mb``, ``block_size`` are accepted for it and unused), plus
    ``tensor_parallel_size``."""

    engine_name = "vllm"

    def __init__(self, *, deployment: str, preset: str, revision: dict, device: str | None = None,
                 l1_mb: int | None = None, l2_mb: int | None = None, block_size: int = 16,
                 test_hooks: bool = False, config: WorkerConfig | None = None, replica: int = 0,
                 dtype: str | None = None, tensor_parallel_size: int = 1) -> None:
        from workers.cache_worker import replica_id

        self.deployment = deployment
        self.preset = preset
        self.replica = int(replica)
        self.replica_id = replica_id(deployment, self.replica)
        self.boot_id = uuid.uuid4().hex  # this process's life: the control plane re-pins named caches on a new one
        cfg = config or WorkerConfig.from_env()
        if l1_mb is not None:  # the caller's size is as explicit as STRATA_L1_MB (workers.vllm_sizing)
            cfg = replace(cfg, l1_mb=l1_mb, l1_mb_explicit=True)
        self.config = cfg
        self.device = "cuda" if (device or _device()).startswith("cuda") else "cpu"
        self.dtype = dtype
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.test_hooks = test_hooks
        threads = cfg.compute_threads()
        os.environ["OMP_NUM_THREADS"] = str(threads)  # Ray set 1 for this actor; vLLM's core inherits it
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with the web tier
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.events = EventLog(self.replica_id)
        self.metrics = CacheMetrics()
        self.decode = DecodeClock()
        self.loop = AsyncLoop(f"vllm-{deployment}")
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.slots = RequestSlots(counters=self.counters, holding=self._holding)  # tenant slots, cancellation
        self._requests: dict[str, _Running] = {}
        self._held: Counter[str] = Counter()  # in-flight tokens per tenant
        self._aborting: set[str] = set()
        self._staged: dict[str, VllmRevision] = {}
        self._generation = 0  # bumped by model/all/revision flushes: every scope's salt changes
        self._scope_gen: OrderedDict[bytes, int] = OrderedDict()  # scope fingerprint -> its flush generation
        self._tenant_scopes: dict[str, set[bytes]] = {}
        self._prefill_rate: float | None = None
        self._flush_epoch = 0  # bumped by every flush; fences the tier service's loads and saves
        self._tier_seq = 1  # the next batch of the active tier service's KV events to forward
        self._tier_bandwidth: dict[str, float] = {}  # the tiers' measured load bandwidth (last stats)
        self._events_lock = threading.Lock()
        self._adapters_checked: dict[int, str] = {}  # adapter id -> the digest its files were found to have
        self.gate = FairGate(cfg.max_batch)
        self._active = self._start(revision)
        self.blocks = DerivedBlocks(self._active.num_blocks, self.events)
        self.kv_api = VllmKVApi(self)
        self.named = VllmNamedCaches(self)

    # ------------------------------------------------------------------ engines
    def _start(self, revision: dict) -> VllmRevision:
        cfg = self.config
        running = getattr(self, "_active", None)  # a rollout stages beside it, on the same GPUs
        rev = VllmRevision.prepare(self.deployment, revision, device=self.device, l1_mb=cfg.l1_mb,
                                   dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                                   weights_root_dir=cfg.weights_root, l1_mb_explicit=cfg.l1_mb_explicit,
                                   gpu_memory_utilization=cfg.gpu_memory_utilization,
                                   engines_on_gpus=(running is not None) + len(self._staged))
        if cfg.vllm_connector and self.tensor_parallel_size == 1 and (cfg.l2_mb > 0 or cfg.l3_url != "none"):
            rev.attach_tiers(self.deployment, dataclasses.asdict(cfg))
        self.loop.run(rev.start(max_num_seqs=self.config.max_batch, device=self.device), timeout=START_TIMEOUT_S)
        return rev

    def close(self) -> None:
        for rev in (self._active, *self._staged.values()):
            rev.shutdown()
        self.loop.stop()

    # ------------------------------------------------------------------ introspection
    def info(self) -> dict:
        a = self._active
        return {
            "deployment": self.deployment, "engine": "vllm", "preset": self.preset, "revision": a.label,
            "weight_digest": a.weight_digest, "device": self.device, "num_blocks": a.num_blocks,
            "l2_blocks": self._l2_blocks(),
            "write_policy": "write_through" if a.tiers else "none",
            "load_policy": self.config.load_policy if a.tiers else "none", "layout": a.layout(),
            "tiers": "strata" if a.tiers else "vllm",
            "architecture": a.facts.architecture, "tensor_parallel_size": self.tensor_parallel_size,
            "vocab_size": a.facts.vocab_size, "max_seq_len": a.facts.max_seq_len, "running": len(self._requests),
            "max_concurrency": MAX_CONCURRENCY, "cancelled": self.counters["cancelled"],
            "tenant_busy": self.counters["tenant_busy"], "replica_id": self.replica_id,
            "namespace_fields": a.namespace_fields(self.deployment), "router": self._router(),
        }

    def ping(self) -> bool:
        return True

    def check_integrity(self) -> bool:
        if self._active.tiers is not None:
            self._tiers("check_integrity")
        return True

    def _tiers(self, op: str, rev: VllmRevision | None = None, *, timeout: float = 120.0, **kwargs):
        """Call the tier service of ``rev`` (the active revision by default); a backend that cannot be
        reached there is ``BackendUnavailable`` here (a job retries)."""
        rev = rev or self._active
        try:
            return rev.tiers.call(op, timeout=timeout, **kwargs)
        except TierCallError as exc:
            if exc.kind == "BackendUnavailable":
                raise BackendUnavailable(str(exc)) from None
            raise

    def _tier_stats(self) -> dict | None:
        if self._active.tiers is None:
            return None
        try:
            return self._tiers("stats", timeout=30.0)
        except Exception as exc:  # figures are best effort; serving goes on
            logger.warning("tier service stats failed: %s", type(exc).__name__)
            return None

    def drain_writes(self) -> None:
        """Wait until the L3 writes queued so far have landed (tests, benchmarks)."""
        if self._active.tiers is not None:
            self._tiers("drain")

    def _bytes_per_block(self) -> int:
        a = self._active
        return a.kv_cache_bytes // max(1, a.num_blocks)

    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        used = self.blocks.count()
        l1 = snap["tiers"].setdefault("l1", self.metrics.tier_row("l1"))
        l1.update(capacity_blocks=self._active.num_blocks, used_blocks=used, evictions=self.blocks.evictions)
        tiers = self._tier_stats()
        resident = {"l1": self.blocks.by_owner()}
        if tiers is not None:
            for name in ("l2", "l3"):
                if name in tiers["tiers"]:
                    snap["tiers"][name] = tiers["tiers"][name]
            resident.update(tiers["resident_blocks"])
            snap["tier_service"] = tiers["service"]
            self._tier_bandwidth = dict(tiers.get("load_cost", {}).get("bandwidth_bytes_per_s") or {})
            snap["flushed_blocks"] = snap.get("flushed_blocks", 0) + tiers.get("flushed_blocks", 0)
        a = self._active
        snap.update(evictions=self.blocks.evictions, duplicate_stores=0, bytes_per_block=self._bytes_per_block(),
                    load_policy=(tiers or {}).get("load_cost") or {"policy": "none"},
                    write_policy="write_through" if a.tiers else "none", resident_blocks=resident)
        snap["pool"] = {"total": self._active.num_blocks, "used": used, "free": self._active.num_blocks - used,
                        "block_size": self._active.block_size}  # as the strata engine's pool: capacity hints
        snap["worker"] = {"deployment": self.deployment, "engine": "vllm", "revision": self._active.label,
                          "boot_id": self.boot_id,
                          "cancelled": self.counters["cancelled"], "tenant_busy": self.counters["tenant_busy"]}
        snap["router"] = self._router()
        snap["kv_events"] = self.events.stats()
        snap["scheduler"] = {"engine": "vllm", **self.gate.snapshot()}
        snap["engine_figures"] = a.figures.snapshot()  # vLLM's own: KV usage, waiting, running, preemptions
        return snap

    def _l2_blocks(self) -> int:
        """Blocks of Strata's L2 under the active engine (0 without the connector): the tier service
        sizes its ``HostStore`` with the same ``WorkerConfig.blocks``."""
        a = self._active
        return self.config.blocks(self.config.l2_mb, a.kv_layout().bytes_per_block) if a.tiers is not None else 0

    def _router(self) -> dict:
        """``workers.router_stats``' section for this replica. ``cached_tokens``: the blocks recorded in
        vLLM's device cache (``DerivedBlocks``) and those the tier service's KV events put in L2, as of
        the last events forwarded (no call to the tier service here: the router polls this often);
        ``capacity_tokens``: vLLM's allocated blocks and L2's."""
        queued = waiting = running = 0
        with self._lock:
            for r in self._requests.values():
                if r.prefilled:
                    running += 1
                else:
                    queued += r.prompt_tokens
                    waiting += 1
        a = self._active
        bs = a.block_size
        l2_cached = self.events.stats()["held"]["l2"] if a.tiers is not None else 0
        return {
            "queued_prefill_tokens": queued, "queued_requests": waiting, "running": running,
            "cached_tokens": (self.blocks.count() + l2_cached) * bs,
            "capacity_tokens": (a.num_blocks + self._l2_blocks()) * bs,
            "rates": {"prefill_tokens_per_s": self._prefill_rate or DEFAULT_PREFILL_TOKENS_PER_S,
                      "load_tokens_per_s": self._load_rates(),
                      "decode_step_s": self.decode.value if self.decode.value is not None else DEFAULT_DECODE_STEP_S},
            "measured": {"prefill": self._prefill_rate is not None, "decode": self.decode.value is not None},
        }

    def _load_rates(self) -> dict:
        """Tokens per second each tier loads at (``workers.router_stats``): L1 is vLLM's device cache;
        L2 and L3, with the connector, the tier service's measured bandwidth (its priors until then)."""
        rates = {"l1": L1_TOKENS_PER_S}
        a = self._active
        if a.tiers is not None:
            per_token = a.kv_layout().bytes_per_block / a.block_size
            for tier in ("l2", "l3"):
                rates[tier] = (self._tier_bandwidth.get(tier) or PRIORS[tier][0]) / per_token
        return rates

    def kv_events(self, since_seq: int) -> dict:
        """``EventLog.page``: the KV event batches from ``since_seq`` on (vLLM's derived device-cache
        blocks, and the tier service's L2 and L3 events, forwarded first)."""
        self._forward_tier_events()
        return self.events.page(since_seq)

    def kv_snapshot(self) -> dict:
        self._forward_tier_events()
        return self.events.snapshot()

    def _forward_tier_events(self) -> None:
        """Republish the tier service's new KV event batches in this replica's log (a service that
        cannot answer now is asked again at the next call)."""
        rev = self._active
        if rev.tiers is None:
            return
        with self._events_lock:
            try:
                page = rev.tier_events.call("events_since", since_seq=self._tier_seq, timeout=1.0)
                if page["gap"]:  # the service's buffer moved on: start again from its snapshot
                    snap = rev.tier_events.call("events_snapshot", timeout=1.0)
                    self.events.publish(AllCleared("l2"), AllCleared("l3"), *(
                        BlockStored(tier, tuple(bytes.fromhex(h) for h in hashes))
                        for tier, hashes in snap["tiers"].items() if tier in ("l2", "l3")))
                    self._tier_seq = snap["seq"] + 1
                    return
            except Exception as exc:
                logger.warning("tier service events unavailable: %s", type(exc).__name__)
                return
            for raw in page["batches"]:
                batch = EventBatch.from_dict(raw)
                self.events.publish(*batch.events)
                self._tier_seq = batch.seq + 1

    # ------------------------------------------------------------------ scope
    @staticmethod
    def _scope_key(scope_salt: bytes) -> bytes:
        return hashlib.blake2b(bytes(scope_salt), digest_size=16, person=b"strata-scope").digest()

    def _salt(self, rev: VllmRevision, req: WorkerRequest) -> str:
        key = self._scope_key(req.scope_salt)
        with self._lock:
            self._tenant_scopes.setdefault(req.tenant, set()).add(key)
            gen = self._scope_gen.get(key, 0)
            generation = self._generation * (1 << 32) + gen
        salt = request_salt(req.cache_salt)
        if not req.use_cache:
            salt += uuid.uuid4().bytes  # a scope of its own: neither reuses nor is reused
        ns = rev.namespace(self.deployment, req.scope_salt, lora_id=lora_id(req))
        return rev.cache_salt(ns, generation=generation, request_salt=salt)

    # ------------------------------------------------------------------ serving
    def stream(self, req: dict) -> Iterator[dict]:
        """Serve one ``WorkerRequest`` (``workers.engine_contract``)."""

        def serve(wr: WorkerRequest, key: str):
            rev = self._active
            return self._stream(wr, key, rev), rev.tokenizer

        yield from self.slots.admitted_stream(req, serve)

    def collect(self, req: dict) -> list[dict]:
        return list(self.stream(req))

    def cancel(self, request_id: str) -> bool:
        return self.slots.cancel(request_id)

    def cancel_tenant(self, tenant: str, *, reason: str = "", wait_seconds: float = CANCEL_TENANT_WAIT_S) -> dict:
        return self.slots.cancel_tenant(tenant, reason=reason, wait_seconds=wait_seconds)


    @staticmethod
    def _error(exc: CacheError) -> dict:
        return error_event(exc.code, str(exc), retryable=exc.code in RETRYABLE)

    def _check(self, req: WorkerRequest, rev: VllmRevision) -> None:
        if req.expected_revision not in (None, rev.label):
            raise RevisionChanged(f"revision {req.expected_revision} is no longer active; retry")
        facts = rev.facts
        if not req.prompt:
            raise InvalidPrompt("the prompt is empty")
        for t in req.prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < facts.vocab_size:
                raise InvalidPrompt(f"token ids must be integers in [0, {facts.vocab_size})")
        if len(req.prompt) + req.max_tokens > facts.max_seq_len:
            raise PromptTooLong(f"prompt of {len(req.prompt)} tokens plus max_tokens={req.max_tokens} exceeds the "
                                f"model's context length of {facts.max_seq_len}")
        if req.lora is not None:
            self._check_adapter(req.lora, rev)

    def _check_adapter(self, lora: dict, rev: VllmRevision) -> None:
        """The engine serves LoRA and the adapter's files are the ones registered (checked once per
        adapter: a changed directory would be served under the old digest's scope)."""
        if rev.lora is None:
            raise AdapterUnsupported(f"revision {rev.label} of this deployment runs without LoRA; "
                                     "adapters cannot be served here")
        if self._adapters_checked.get(lora["id"]) == lora.get("digest"):
            return
        from pathlib import Path

        from cachecore.model.peft import digest

        try:
            found = digest(Path(lora["path"]))
        except OSError:
            found = None
        if found != lora.get("digest"):
            raise AdapterUnsupported(f"the files of adapter {lora.get('name')!r} changed since it was registered; "
                                     "register the new files as a new adapter")
        self._adapters_checked[lora["id"]] = found

    def _admit(self, req: WorkerRequest, key: str, rev: VllmRevision) -> None:
        """Count the request's tokens against the tenant's in-flight bound, then wait for a fair slot."""
        held = len(req.prompt) + req.max_tokens
        limit = req.max_inflight_tokens
        if limit is None:
            limit = rev.num_blocks * rev.block_size // 2
        elif limit > 0:  # as on the reference engine: at least one block, in whole blocks
            limit = max(1, limit // rev.block_size) * rev.block_size
        with self._lock:
            # as on the reference engine, one request may exceed the bound alone (else a long prompt
            # could never run); a bound of 0 admits nothing
            busy = self._held[req.tenant]
            if (busy or not limit) and busy + held > limit:
                self.counters["inflight_limit"] += 1
                raise InflightLimit(f"this tenant's running requests would hold {self._held[req.tenant] + held} "
                                    f"tokens; its limit is {limit}; retry shortly")
            self._held[req.tenant] += held
            self._requests[key] = _Running(req.tenant, rev.label, len(req.prompt), held)
        admitted = False
        try:
            admitted = self.gate.acquire(req.tenant, req.share_weight, cost=held,
                                         should_stop=lambda: self.slots.cancelled(key) is not None)
        finally:
            if not admitted:
                self._forget(key)
        if not admitted:
            raise self._stopped(key, rev)

    def _forget(self, key: str) -> None:
        with self._lock:
            r = self._requests.pop(key, None)
            if r is not None:
                self._held[r.tenant] -= r.held_tokens
                if self._held[r.tenant] <= 0:
                    del self._held[r.tenant]

    def _stopped(self, key: str, rev: VllmRevision) -> CacheError:
        stopped = self.slots.stop_error(key)
        if stopped is not None:
            self.counters["cancelled"] += 1
            return stopped
        return RevisionChanged(f"revision {rev.label} was replaced while this request ran; retry")

    def _hashes(self, rev: VllmRevision, req: WorkerRequest) -> list[bytes]:
        """Strata's block keys of the prompt in the request's scope (none for an uncached request)."""
        if not req.use_cache:
            return []
        ns = rev.namespace(self.deployment, req.scope_salt, lora_id=lora_id(req))
        return chain_hashes(ns, req.prompt, rev.block_size, request_salt=request_salt(req.cache_salt))

    def _transfer(self, rev: VllmRevision, req: WorkerRequest, hashes: list[bytes]) -> dict | None:
        """The request's ``kv_transfer_params`` for Strata's connector (None: vLLM's cache only)."""
        if rev.tiers is None or not req.use_cache or not hashes:
            return None
        ns = rev.namespace(self.deployment, req.scope_salt, lora_id=lora_id(req))
        return TransferParams(
            tenant=req.tenant, model=self.deployment, revision=tag_revision(rev.label, req), ns_digest=ns.digest,
            hashes=tuple(hashes),
            epoch=self._flush_epoch, share_weight=req.share_weight, max_cached_tokens=req.max_cached_tokens,
            max_l3_bytes=req.max_l3_bytes, persist=req.persist, retention_seconds=req.retention_seconds,
            tenant_retention_seconds=req.tenant_retention_seconds, data_key=req.data_key,
            prefill_tokens_per_s=self._prefill_rate,
        ).to_wire()

    def _sampling(self, req: WorkerRequest, transfer: dict | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        temperature = float(req.temperature or 0.0)
        return SamplingParams(
            max_tokens=req.max_tokens, temperature=temperature,
            seed=req.seed if temperature > 0 and req.seed is not None else None,
            # a few more than asked: tokens whose texts coincide (parts of one character) share a key
            logprobs=None if req.logprobs is None else min(MAX_LOGPROBS, req.logprobs + 5 if req.logprobs else 0),
            detokenize=False, output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
        )

    def _stream(self, req: WorkerRequest, key: str, rev: VllmRevision) -> Iterator[dict]:
        rid = f"{key}-{uuid.uuid4().hex[:8]}"
        submitted = False
        try:
            self._check(req, rev)
            self._admit(req, key, rev)
            try:
                out_q: queue.SimpleQueue = queue.SimpleQueue()
                prompt = {"prompt_token_ids": list(req.prompt), "cache_salt": self._salt(rev, req)}
                hashes = self._hashes(rev, req)
                t0 = time.perf_counter()
                self.loop.submit(self._pump(rev, prompt, self._sampling(req, self._transfer(rev, req, hashes)), rid,
                                            out_q, self._lora_request(req)))
                submitted = True
                yield from self._events(req, key, rev, out_q, t0, hashes)
                submitted = False  # finished normally: nothing to abort
            finally:
                if submitted:
                    self.loop.submit(self._abort(rev, rid))
                self.gate.release(req.tenant)
                self._forget(key)
        except CacheError as exc:
            yield self._error(exc)

    @staticmethod
    def _lora_request(req: WorkerRequest):
        if req.lora is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=req.lora["scope"], lora_int_id=int(req.lora["id"]), lora_path=req.lora["path"])

    async def _pump(self, rev: VllmRevision, prompt: dict, params, rid: str, out_q: queue.SimpleQueue,
                    lora_request=None) -> None:
        try:
            async for out in rev.engine.generate(prompt, params, request_id=rid, lora_request=lora_request):
                out_q.put(out)
        except BaseException as exc:  # handed to the consumer, which turns it into an error event
            out_q.put(exc)
        finally:
            out_q.put(_END)

    @staticmethod
    async def _abort(rev: VllmRevision, rid: str) -> None:
        if rev.engine is not None:
            await rev.engine.abort(rid)

    def _events(self, req: WorkerRequest, key: str, rev: VllmRevision, out_q: queue.SimpleQueue,
                t0: float, hashes: list[bytes]) -> Iterator[dict]:
        prompt_tokens, cached, generated = len(req.prompt), 0, 0
        prefilled, resumed, finish, outcome = False, None, None, {}
        while True:
            try:
                item = out_q.get(timeout=_POLL_S)
            except queue.Empty:
                if self.slots.cancelled(key) is not None or rev.label in self._aborting:
                    raise self._stopped(key, rev) from None
                continue
            if item is _END:
                break
            if isinstance(item, BaseException):
                if isinstance(item, ValueError):
                    raise InvalidPrompt(str(item)[:300]) from None
                raise _EngineFailed(f"the vLLM engine failed on this request: {type(item).__name__}") from None
            if self.slots.cancelled(key) is not None or rev.label in self._aborting:
                raise self._stopped(key, rev)
            if not prefilled:
                prefilled = True
                cached = int(item.num_cached_tokens or 0)
                self._prefilled(req, key, rev, cached, time.perf_counter() - t0, hashes)
                yield prefilled_event(prompt_tokens=prompt_tokens, cached_tokens=cached, revision=rev.label)
            completion = item.outputs[0]
            lps = completion.logprobs or [None] * len(completion.token_ids)
            for tid, lp in zip(completion.token_ids, lps, strict=False):
                if resumed is not None:
                    self.decode.observe(time.perf_counter() - resumed)
                generated += 1
                yield self._token(rev, int(tid), lp, req.logprobs)
                resumed = time.perf_counter()
            if completion.finish_reason is not None:
                finish = completion.finish_reason
                outcome = (getattr(item, "kv_transfer_params", None) or {}).get(KEY) or {}
        if finish == "abort" or finish is None:
            raise self._stopped(key, rev)
        yield finished_event(finish_reason="length" if finish == "length" else "stop", revision=rev.label,
                             prompt_tokens=prompt_tokens, completion_tokens=generated, cached_tokens=cached,
                             **self._cache_usage(rev, req, cached, outcome))

    def _cache_usage(self, rev: VllmRevision, req: WorkerRequest, cached: int, outcome: dict) -> dict:
        """Where ``cached`` came from: Strata's connector reports the blocks it loaded from L2 and L3
        (``StrataConnector.request_finished``); the rest was vLLM's own device cache (L1). vLLM caches
        every full prompt block it computes, so the tokens written are those full blocks not cached."""
        bs = rev.block_size
        loaded = outcome.get("loaded") or {}
        l2, l3 = int(loaded.get("l2", 0)) * bs, int(loaded.get("l3", 0)) * bs
        l2, l3 = min(l2, cached), min(l3, max(0, cached - l2))
        written = max(0, len(req.prompt) // bs * bs - cached) if req.use_cache else 0
        return {"by_tier": {"l1": cached - l2 - l3, "l2": l2, "l3": l3}, "write_tokens": written,
                "load_stop": outcome.get("stop"), "replica": self.replica_id, "block_size": bs}

    @staticmethod
    def _token(rev: VllmRevision, tid: int, lp, k: int | None) -> dict:
        """A token event; with ``logprobs`` the chosen token's and (k > 0) the k most likely ones',
        keyed by their text as the reference engine does (vLLM returns the top k plus the chosen)."""
        if k is None or lp is None:
            return token_event(tid)
        chosen = lp.get(tid)
        top = None
        if k > 0:
            top = {}
            ranked = sorted((v.rank, i, v.logprob) for i, v in lp.items() if v.rank is not None)
            for _, i, logprob in ranked:
                top.setdefault(rev.tokenizer.decode([int(i)]), float(logprob))
                if len(top) == k:
                    break
        return token_event(tid, "", float(chosen.logprob) if chosen is not None else None, top)

    def _prefilled(self, req: WorkerRequest, key: str, rev: VllmRevision, cached: int, seconds: float,
                   hashes: list[bytes]) -> None:
        with self._lock:
            r = self._requests.get(key)
            if r is not None:
                r.prefilled = True
        computed = len(req.prompt) - cached
        self.metrics.record_query(tenant=req.tenant, model=self.deployment, query_tokens=len(req.prompt),
                                  lookup_hit_tokens=cached, load_success_tokens=cached, effective_hit_tokens=cached)
        self.metrics.record_prefill(tenant=req.tenant, model=self.deployment, seconds=seconds, computed=computed,
                                    skipped=cached)
        if computed >= 128 and seconds > 0:
            rate = computed / seconds
            self._prefill_rate = rate if self._prefill_rate is None else 0.8 * self._prefill_rate + 0.2 * rate
        if hashes:
            self.blocks.stored(req.tenant, tag_revision(rev.label, req), hashes)

    def _holding(self, tenant: str) -> int:  # RequestSlots.cancel_tenant waits for this to reach 0
        with self._lock:
            return sum(1 for r in self._requests.values() if r.tenant == tenant)

    # ------------------------------------------------------------------ jobs
    def _bump(self, tenant: str) -> list[str]:
        """A tenant flush: every scope the tenant was seen in gets a new generation; the tenants seen in
        those scopes (a share group) lose their recorded blocks with it."""
        with self._lock:
            keys = self._tenant_scopes.get(tenant, set())
            for k in keys:
                self._scope_gen[k] = self._scope_gen.get(k, 0) + 1
                self._scope_gen.move_to_end(k)
            if len(self._scope_gen) > _SCOPE_MEMORY:
                # forgetting one scope's generation would give it back its pre-flush salt: instead
                # every scope moves to a new generation at once (a miss for all, never a stale hit)
                self._generation += 1
                self._scope_gen.clear()
            return [t for t, ks in self._tenant_scopes.items() if ks & keys] or [tenant]

    def flush(self, scope: dict) -> dict:
        """``workers.engine_contract.ServingEngine.flush``: a new flush generation for the scope (its
        next requests cannot reach what was cached before), vLLM's prefix cache reset for a model, a
        revision or everything, and the scope's L2 blocks and L3 objects deleted by the tier service
        (requests sent before the flush neither load nor save in it afterwards). Raises
        ``BackendUnavailable`` when L3 could not be reached (the job retries)."""
        t0 = time.perf_counter()
        kind = scope.get("scope")
        freed = 0
        with self._lock:
            self._flush_epoch += 1
            epoch = self._flush_epoch
        if kind == "tenant":
            tenants = set(self._bump(str(scope["tenant"])))
            freed = self.blocks.flush(lambda owner, rev: owner in tenants)
        elif kind in ("model", "all", "revision"):
            label = scope.get("revision")
            if kind != "revision" or label == self._active.label or label in self._staged:
                with self._lock:
                    self._generation += 1
                for rev in (self._active, *self._staged.values()):
                    if kind != "revision" or rev.label == label:
                        self.loop.run(self._reset(rev), timeout=60)
            freed = self.blocks.flush(lambda owner, rev: kind != "revision" or label_of(rev) == label)
        elif kind == "adapter":  # its scope never recurs (lora_id): unload it, forget its blocks
            for rev in (self._active, *self._staged.values()):
                if rev.lora is not None:
                    self.loop.run(self._unload(rev, int(scope["lora_id"])), timeout=60)
            self._adapters_checked.pop(int(scope["lora_id"]), None)
            freed = self.blocks.flush(lambda owner, rev: rev.endswith("~" + scope["adapter"]))
        elif kind not in ("key_version", "tenant_l3", "l3_expire"):
            raise ValueError(f"unknown flush scope {kind!r}")
        n2 = n3 = b3 = 0
        for rev in (self._active, *self._staged.values()):
            if rev.tiers is not None:
                done = self._tiers("flush", rev, scope=scope, epoch=epoch)
                n2 += done["l2"]
                if rev is self._active:  # L3 is one store for every revision's service
                    n3, b3 = done["l3"], done["l3_bytes"]
        bs, bpb = self._active.block_size, self._bytes_per_block()
        return {"blocks_freed": freed + n2 + n3 * max(1, CHUNK_TOKENS // bs), "tokens_dropped": (freed + n2) * bs,
                "tiers": {"l1": freed, "l2": n2, "l3": n3}, "l3_bytes": b3, "bytes": (freed + n2) * bpb + b3,
                "seconds": round(time.perf_counter() - t0, 6)}

    @staticmethod
    async def _unload(rev: VllmRevision, lora_int_id: int) -> bool:
        return bool(await rev.engine.remove_lora(lora_int_id)) if rev.engine is not None else True

    @staticmethod
    async def _reset(rev: VllmRevision) -> bool:
        return bool(await rev.engine.reset_prefix_cache()) if rev.engine is not None else True

    def probe(self, scope: dict) -> dict:
        """Blocks of ``scope`` this replica still records (0: its requests miss: every block cached
        before the flush is under an older ``cache_salt``)."""
        kind = scope.get("scope")
        if kind == "tenant":
            tenant = str(scope["tenant"])
            remaining = self.blocks.count(lambda owner, rev: owner == tenant)
        elif kind == "revision":
            remaining = self.blocks.count(lambda owner, rev: label_of(rev) == scope.get("revision"))
        elif kind == "adapter":
            remaining = self.blocks.count(lambda owner, rev: rev.endswith("~" + scope["adapter"]))
        elif kind in ("model", "all"):
            remaining = self.blocks.count()
        else:
            remaining = 0
        if self._active.tiers is not None:
            remaining += self._tiers("probe", scope=scope)
        return {"remaining_blocks": remaining, "ok": remaining == 0}

    def stage_revision(self, revision: dict) -> dict:
        """Start a second vLLM engine on the new revision (nothing serves from it yet)."""
        label = str(revision["label"])
        with self._lock:
            if label == self._active.label or label in self._staged:
                rev = self._active if label == self._active.label else self._staged[label]
                return {"revision": label, "weight_digest": rev.weight_digest}
        rev = self._start(revision)
        with self._lock:
            self._staged[label] = rev
        return {"revision": label, "weight_digest": rev.weight_digest}

    def switch_revision(self, label: str, *, drain_seconds: float = 10.0) -> dict:
        """``ServingEngine.switch_revision``: new requests on the staged engine now, the old one's
        drained until the deadline (the rest aborted, retryable), then the old engine shut down."""
        with self._lock:
            if self._active.label == label:
                return {"switched": False, "revision": label, "aborted": 0, "blocks_freed": 0}
            new = self._staged.pop(label, None)
            if new is None:
                raise ValueError(f"revision {label!r} is not staged on this worker")
            old = self._active
            self._active = new
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and self._running_of(old.label):
            time.sleep(0.01)
        aborted = self._running_of(old.label)
        if aborted:
            self._aborting.add(old.label)
            while self._running_of(old.label):
                time.sleep(0.01)
            self._aborting.discard(old.label)
        freed = self.blocks.flush(lambda owner, rev: label_of(rev) == old.label)
        bpb = self._bytes_per_block()
        old.shutdown()
        with self._events_lock:  # the old engine's L2 is gone with it; the new service's log starts at 1
            self.events.publish(AllCleared("l2"))
            self._tier_seq = 1
        tiers, l3_bytes = {"l1": freed, "l2": 0, "l3": 0}, 0
        if new.tiers is not None:  # the old revision's L3 objects go; it may never load or save again
            try:
                done = self._tiers("retire", new, revision=old.label)
                tiers["l2"], tiers["l3"] = int(done["l2"]), int(done.get("l3", 0))
                l3_bytes = int(done.get("l3_bytes", 0))
                freed += done["l2"]
            except BackendUnavailable:
                logger.warning("L3 unreachable while retiring revision %s: its objects stay until a flush", old.label)
        return {"switched": True, "from": old.label, "revision": label, "aborted": aborted, "blocks_freed": freed,
                "tiers": tiers, "l3_bytes": l3_bytes, "bytes": (tiers["l1"] + tiers["l2"]) * bpb + l3_bytes}

    def _running_of(self, label: str) -> int:
        with self._lock:
            return sum(1 for r in self._requests.values() if r.revision == label)

    def drop_data_key(self, req: dict) -> dict:
        """Crypto-shred ``{"tenant", "version"}``: the tier service forgets the key at once, then that
        version's L3 objects are deleted. ``{"objects", "bytes"}``. Idempotent."""
        if self._active.tiers is None:
            return {"objects": 0, "bytes": 0}
        return self._tiers("drop_data_key", tenant=str(req["tenant"]), version=int(req["version"]))

    # ------------------------------------------------------------------ KV API (workers.vllm_kv_api)
    def kv_layout(self) -> dict:
        return self.kv_api.layout()

    def kv_lookup(self, req: dict) -> dict:
        return self.kv_api.lookup(req)

    def kv_retrieve(self, req: dict):
        return self.kv_api.retrieve(req)

    def kv_store(self, req: dict, kv) -> int:
        return self.kv_api.store(req, kv)

    def kv_store_wire(self, req: dict, kv: dict) -> int:
        """``kv_store`` of the blocks ``kv`` describes (``workers.protocol.KVWire``: the web tier's call)."""
        return self.kv_api.store(req, from_wire(kv))

    def kv_retrieve_wire(self, req: dict) -> dict:
        """``kv_retrieve`` as ``{"hit_tokens", "origin", "kv": KVWire}`` (the web tier's call)."""
        return retrieved_wire(*self.kv_api.retrieve(req))

    # ------------------------------------------------------------------ named caches (workers.named_caches)
    # vLLM's device cache (L1) cannot be edited per block from outside: ``l1`` is the replica's record
    # of what vLLM computed (an estimate); pins and deletes reach Strata's L2 and L3 only.
    def prewarm(self, req: dict, pin_until: float | None = None) -> dict:
        """``workers.named_caches``: serve ``req``, let its L2/L3 writes land, pin its prompt's blocks in
        L2 and L3 until ``pin_until``: ``{"tokens", "cached_tokens", "tiers", "pinned"}`` or ``{"error"}``."""
        return self.named.prewarm(req, pin_until)

    def cache_pin(self, req: dict, pin_until: float | None) -> dict:
        """(Re)pin (None: unpin) the prompt's blocks in L2 and L3: ``{"tiers"}``."""
        return self.named.cache_pin(req, pin_until)

    def cache_drop(self, req: dict) -> dict:
        """Delete the prompt's blocks from L2 and its L3 objects (vLLM's device cache keeps its copy
        until vLLM evicts it): ``{"tiers": {"l1": 0, "l2": blocks, "l3": objects}, "bytes"}``."""
        return self.named.cache_drop(req)

    def cache_resident(self, req: dict) -> dict:
        """``{"tiers": {"l1" (estimate), "l2", "l3"}}``: tokens of the prompt's prefix per tier."""
        return self.named.cache_resident(req)

    def poison_free_blocks(self) -> int:
        raise PermissionError("test hooks are not available on vLLM replicas")


class _EngineFailed(CacheError):
    code = "worker_failed"
