"""CacheWorker: the plain class behind each Ray actor. Owns one model deployment's cache and model.

It never touches a database: the control plane resolves the tenant, its scope salt and the model's
active revision, and hands them in with each request. All inputs and outputs are plain data (dicts,
lists, bytes) so the same calls work in-process (tests) and through Ray.

Concurrency: many requests may stream at once (threads, ``MAX_CONCURRENCY`` per actor); the engine's
lock guards the bookkeeping and one ``Scheduler`` loop owns the model: it batches every running
request's forwards (continuous batching, chunked prefill, fair between tenants). Each tenant
may run at most ``max_concurrent_requests`` requests at once on a worker (None: a quarter of the
slots; 0: none; over it: ``tenant_busy``, retryable), counting its streams and its KV API calls alike,
so one tenant's queue cannot fill every slot. ``cancel_tenant`` stops every request of a tenant (it
was suspended, offboarded or its data key shredded). A failing or cancelled request releases its
blocks in ``finally`` and leaves the pool intact (``check_integrity`` holds after every call).

The worker serves completions itself and hands every other job to one role object, built here with
its collaborators: ``slots`` (``workers.admission.RequestSlots``: tenant slots, cancellation),
``revisions`` (``workers.revisions.RevisionManager``: the active and staged revisions, rollout),
``kv_api`` (``workers.kv_api.StrataKVApi``), ``ops`` (``workers.operations.Operations``: flush, probe,
data-key shreds, integrity, drains, the poisoning hook) and ``named`` (``workers.named_caches.StrataNamedCaches``). Its
public methods (``workers.engine_contract``, and what the actor delegates) are one-line delegations.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import torch

from cachecore.engine import CacheEngine, Tag
from cachecore.errors import AdapterUnsupported, CacheError
from cachecore.events import EventLog
from cachecore.routing.hashes import namespace_fields, request_salt
from cachecore.runner import Finished, Prefilled, SamplingParams, TokenOut
from cachecore.scheduler import Scheduler
from workers.admission import (  # noqa: F401  (re-exported: callers import them from here too)
    CANCEL_TENANT_WAIT_S,
    DEFAULT_TENANT_CONCURRENCY,
    MAX_CONCURRENCY,
    RequestSlots,
    tenant_concurrency,
)
from workers.config import WorkerConfig
from workers.kv_api import StrataKVApi
from workers.kv_wire import from_wire, retrieved_wire
from workers.named_caches import StrataNamedCaches
from workers.operations import Operations
from workers.protocol import (
    KVRetrieved,
    KVWire,
    WorkerRequest,
    error_event,
    finished_event,
    prefilled_event,
    token_event,
)
from workers.revisions import Revision, RevisionManager, load_revision
from workers.router_stats import DecodeClock, router_section
from workers.worker_l3 import WorkerL3

RETRYABLE = frozenset({"revision_changed", "out_of_blocks", "inflight_limit", "tenant_busy", "request_stopped"})


class RevisionChanged(CacheError):
    """The request's revision was rolled out from under it; retry to run on the new one."""

    code = "revision_changed"


def replica_id(deployment: str, replica: int) -> str:
    """``<deployment>:<replica index>:<boot id>``: the boot id is random per process start, so a
    restarted replica is a new id whose KV events start over (seq 1) from an empty cache."""
    return f"{deployment}:{int(replica)}:{secrets.token_hex(4)}"


class CacheWorker:
    """One model deployment: the active revision, one L1 engine, and revisions being rolled out.
    Serves completions; every other job is a role object's (module docstring)."""

    def __init__(
        self,
        *,
        deployment: str,
        preset: str,
        revision: dict,
        device: str | None = None,
        l1_mb: int | None = None,
        l2_mb: int | None = None,
        block_size: int = 16,
        test_hooks: bool = False,
        config: WorkerConfig | None = None,
        replica: int = 0,
        dtype: str | None = None,
    ) -> None:
        self.deployment = deployment
        self.replica = int(replica)
        self.replica_id = replica_id(deployment, self.replica)
        self.boot_id = uuid.uuid4().hex  # this process's life: the control plane re-pins named caches on a new one
        self.events = EventLog(self.replica_id)  # KV events of every tier (kv_events, kv_snapshot)
        self.decode = DecodeClock()
        self.preset = preset
        cfg = config or WorkerConfig.from_env()
        if l1_mb is not None or l2_mb is not None:
            cfg = replace(cfg, l1_mb=cfg.l1_mb if l1_mb is None else l1_mb,
                          l2_mb=cfg.l2_mb if l2_mb is None else l2_mb)
        self.config = cfg
        # This thread (the actor's) computes nothing: one intra-op thread, never a thread pool. The weights
        # load on a passing thread and the forwards run on the scheduler's loop thread, on the worker's
        # compute threads (``load_revision``, ``WorkerConfig.step_threads``): one pool in the process.
        torch.set_num_threads(1)
        self.block_size = block_size
        self.dtype = dtype  # None: the preset's (or the checkpoint's serving) dtype; staged revisions use it too
        loaded = load_revision(deployment, preset, revision, config=cfg, device=device, block_size=block_size,
                               dtype=dtype)
        layout = loaded.layout
        num_blocks = max(64, cfg.blocks(cfg.l1_mb, layout.bytes_per_block))
        self.l3 = WorkerL3.build(cfg, layout)
        self.engine = CacheEngine(layout, num_blocks, loaded.model.device,
                                  config=cfg.engine(bytes_per_block=layout.bytes_per_block),
                                  l3=self.l3.store if self.l3 is not None else None, events=self.events)
        self.scheduler = Scheduler(self.engine, token_budget=cfg.token_budget, max_batch=cfg.max_batch,
                                   lean_budget=cfg.lean_budget, contended_budget=cfg.contended_budget,
                                   anticipate_ms=cfg.anticipate_ms,
                                   threads=cfg.step_threads(str(loaded.model.device)))
        self.test_hooks = test_hooks
        self.counters: Counter[str] = Counter()  # cancelled, tenant_busy (reported by info/stats)
        self.slots = RequestSlots(counters=self.counters, holding=self._holding)
        self.revisions = RevisionManager(loaded, engine=self.engine, scheduler=self.scheduler, deployment=deployment,
                                         preset=preset, config=cfg, block_size=block_size, dtype=dtype)
        self.kv_api = StrataKVApi(self.engine, scheduler=self.scheduler, revisions=self.revisions, slots=self.slots,
                                  deployment=deployment, block_size=block_size)
        self.ops = Operations(self.engine, l3=self.l3, deployment=deployment, test_hooks=test_hooks)
        self.named = StrataNamedCaches(self.engine, revisions=self.revisions, deployment=deployment,
                                       learn=self._learn, collect=self.collect)

    def _holding(self, tenant: str) -> int:
        """Requests of ``tenant`` the engine still runs (admitted ones hold blocks, waiting ones too)."""
        return sum(1 for s in self.engine.running() if s.tag.owner == tenant)

    # ------------------------------------------------------------------ introspection
    def info(self) -> dict:
        a = self.revisions.active.loaded
        return {
            "deployment": self.deployment,
            "preset": self.preset,
            "revision": a.revision.label,
            "weight_digest": a.weight_digest,
            "device": str(self.engine.pages.device),
            "num_blocks": self.engine.pool.num_blocks,
            "l2_blocks": self.engine.l2.pool.num_blocks if self.engine.l2 is not None else 0,
            "write_policy": self.engine.write_policy.name,
            "load_policy": self.engine.cost.policy,
            "layout": a.layout.canonical(),
            "vocab_size": a.config.vocab_size,
            "max_seq_len": a.config.max_seq_len,
            "running": len(self.engine.running()),
            "max_concurrency": MAX_CONCURRENCY,
            "cancelled": self.counters["cancelled"],
            "tenant_busy": self.counters["tenant_busy"],
            "replica_id": self.replica_id,
            # any salt will do: the fields read back from the namespace leave the salt out
            "namespace_fields": namespace_fields(a.namespace(bytes(32)), self.block_size),
            "router": router_section(self.engine, self.decode),
        }

    def ping(self) -> bool:
        return True

    def stats(self) -> dict:
        revision = self.revisions.active.label
        snap = self.engine.snapshot(l3_scope=(self.deployment, revision))
        snap["worker"] = {"deployment": self.deployment, "revision": revision,
                          "boot_id": self.boot_id,
                          "cancelled": self.counters["cancelled"], "tenant_busy": self.counters["tenant_busy"]}
        snap["router"] = router_section(self.engine, self.decode)
        snap["kv_events"] = self.events.stats()
        snap["scheduler"] = self.scheduler.snapshot()
        return snap

    # ------------------------------------------------------------------ KV events (for routers)
    def kv_events(self, since_seq: int) -> dict:
        """KV event batches of this replica from ``since_seq`` on (inclusive: pass the next seq you
        expect, ``PrefixIndex.expected_seq``; 1 for everything still buffered): ``{"replica_id",
        "seq" (the last published), "gap", "batches": [EventBatch.to_dict()...]}``. ``gap`` True
        (no batches) means batch ``since_seq`` is no longer buffered: reconcile from
        ``kv_snapshot()``. Raises ``ValueError`` for a ``since_seq`` that is not an int >= 1."""
        return self.events.page(since_seq)

    def kv_snapshot(self) -> dict:
        """Every tier's block hashes (hex) as of ``seq``: ``{"replica_id", "seq", "tiers"}``."""
        return self.events.snapshot()

    # ------------------------------------------------------------------ serving
    def stream(self, req: dict) -> Iterator[dict]:
        """Serve one request: a ``workers.protocol.WorkerRequest`` as a dict (its fields are documented
        there; the control plane tokenizes and renders chat templates, so limits and quotas are
        checked before a worker is involved). ``stop``: see ``workers.stops`` (token texts are
        decoded incrementally and generation ends at a stop sequence, which is not returned).
        Yields the protocol's events: ``prefilled``, ``token``..., then ``finished`` or ``error``."""

        def serve(wr: WorkerRequest, key: str):
            active = self.revisions.active  # one revision's tokenizer decodes what its model generates
            return self._stream(wr, key, active), active.loaded.tokenizer

        yield from self.slots.admitted_stream(req, serve)

    def _set_weight(self, tenant: str, weight: int | None) -> None:
        """The tenant's fair-share weight (its quota; ``None`` = 1) in the cache pools and the scheduler."""
        self.engine.set_weight(tenant, weight)
        self.scheduler.set_weight(tenant, 1 if weight is None else weight)  # 0 is refused, never 1

    def _learn(self, req: WorkerRequest) -> None:
        """The tenant's wrapped data keys and retention, as the control plane sent them (for L3):
        ``tenant_retention_seconds`` is the tenant's own (the sweep's), ``retention_seconds`` this
        request's (possibly narrowed), used for the tenant only when the former is absent."""
        if self.l3 is not None:
            retention = req.tenant_retention_seconds
            self.l3.learn(req.tenant, req.data_key, req.retention_seconds if retention is None else retention)
            self.l3.store.set_tenant_limit(req.tenant, req.max_l3_bytes)

    def _retention_of(self, req: WorkerRequest) -> float | None:
        if self.l3 is None:
            return None
        value = req.retention_seconds
        return float(value) if value is not None else self.l3.retention(req.tenant)

    @staticmethod
    def _error(exc: CacheError) -> dict:
        return error_event(exc.code, str(exc), retryable=exc.code in RETRYABLE)

    def _stream(self, req: WorkerRequest, key: str, active: Revision) -> Iterator[dict]:
        revision = active.loaded.revision.label
        tenant = req.tenant
        try:
            if req.expected_revision not in (None, revision):
                raise RevisionChanged(f"revision {req.expected_revision} is no longer active; retry")
            if req.lora is not None:
                raise AdapterUnsupported("the reference engine serves no LoRA adapters (use engine 'vllm')")
            self._learn(req)
            self.engine.set_tenant_cap(tenant, req.max_cached_tokens)
            self.engine.set_inflight_limit(tenant, req.max_inflight_tokens)
            self._set_weight(tenant, req.share_weight)
            ns = active.loaded.namespace(req.scope_salt)
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, seed=req.seed,
                                    logprobs=req.logprobs)
            events = active.runner.stream(
                ns, req.prompt, owner=tenant, params=params, request_salt=request_salt(req.cache_salt),
                use_cache=req.use_cache, persist=req.persist,
                # this request's own retention (the tenant's, narrowed by prompt_cache_retention): what
                # L3 may serve it, and the expiry of every chunk it writes
                retention_seconds=self._retention_of(req),
                should_abort=lambda: self.revisions.aborting(revision) or self.slots.cancelled(key) is not None,
            )
            resumed = None  # when the consumer handed control back after the last token
            for ev in events:
                if isinstance(ev, Prefilled):
                    yield prefilled_event(prompt_tokens=ev.prompt_tokens, cached_tokens=ev.cached_tokens,
                                          revision=revision)
                elif isinstance(ev, TokenOut):
                    if resumed is not None:  # one decode step (its wait for the model included)
                        self.decode.observe(time.perf_counter() - resumed)
                    yield token_event(ev.token_id, ev.text, ev.logprob, ev.top_logprobs)
                    resumed = time.perf_counter()
                elif isinstance(ev, Finished):
                    done = finished_event(finish_reason=ev.finish_reason, revision=revision,
                                          prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                          cached_tokens=ev.cached_tokens, by_tier=ev.cached_by_tier,
                                          write_tokens=ev.write_tokens, load_stop=ev.load_stop,
                                          replica=self.replica_id, block_size=self.engine.block_size)
                    if ev.finish_reason == "aborted":
                        stopped = self.slots.stop_error(key)
                        if stopped is None:
                            raise RevisionChanged(f"revision {revision} was replaced while this request ran; retry")
                        self.counters["cancelled"] += 1
                        # with what it did before it stopped: the KV it committed stays cached
                        yield {**self._error(stopped), "usage": done["usage"]}
                        return
                    yield done
        except CacheError as exc:
            yield self._error(exc)

    def collect(self, req: dict) -> list[dict]:
        """All events of ``stream`` at once (one round trip for non-streaming API calls)."""
        return list(self.stream(req))

    # ------------------------------------------------------------------ the roles' jobs (see the module docstring)
    def cancel(self, request_id: str) -> bool:
        return self.slots.cancel(request_id)

    def cancel_tenant(self, tenant: str, *, reason: str = "", wait_seconds: float = CANCEL_TENANT_WAIT_S) -> dict:
        return self.slots.cancel_tenant(tenant, reason=reason, wait_seconds=wait_seconds)

    def stage_revision(self, revision: dict) -> dict:
        return self.revisions.stage(revision)

    def switch_revision(self, label: str, *, drain_seconds: float = 10.0) -> dict:
        return self.revisions.switch(label, drain_seconds=drain_seconds)

    def kv_layout(self) -> dict:
        return self.kv_api.layout()

    def kv_lookup(self, req: dict) -> dict:
        return self.kv_api.lookup(req)

    def kv_store(self, req: dict, kv) -> int:
        return self.kv_api.store(req, kv)

    def kv_retrieve(self, req: dict):
        return self.kv_api.retrieve(req)

    def kv_store_wire(self, req: dict, kv: KVWire) -> int:
        """``kv_store`` of the blocks ``kv`` describes (the web tier's call: no tensor crosses to it)."""
        return self.kv_api.store(req, from_wire(kv))

    def kv_retrieve_wire(self, req: dict) -> KVRetrieved:
        """``kv_retrieve`` as ``{"hit_tokens", "origin", "kv": KVWire}`` (the web tier's call)."""
        return retrieved_wire(*self.kv_api.retrieve(req))

    def flush(self, scope: dict) -> dict:
        return self.ops.flush(scope)

    def probe(self, scope: dict) -> dict:
        return self.ops.probe(scope)

    def drop_data_key(self, req: dict) -> dict:
        return self.ops.drop_data_key(req)

    def check_integrity(self) -> bool:
        return self.ops.check_integrity()

    def drain_writes(self) -> None:
        self.ops.drain_writes()

    def poison_free_blocks(self) -> int:
        return self.ops.poison_free_blocks()

    def prewarm(self, req: dict, pin_until: float | None = None) -> dict:
        return self.named.prewarm(req, pin_until)

    def cache_pin(self, req: dict, pin_until: float | None) -> dict:
        return self.named.cache_pin(req, pin_until)

    def cache_drop(self, req: dict) -> dict:
        return self.named.cache_drop(req)

    def cache_resident(self, req: dict) -> dict:
        return self.named.cache_resident(req)


__all__ = ["CacheWorker", "RevisionChanged", "Tag", "request_salt"]
