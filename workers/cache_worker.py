"""CacheWorker: the plain class behind each Ray actor. Owns one model deployment's cache and model.

It never touches a database: the control plane resolves the tenant, its scope salt and the model's
active revision, and hands them in with each request. All inputs and outputs are plain data (dicts,
lists, bytes) so the same calls work in-process (tests) and through Ray.

Concurrency: many requests may stream at once (threads, ``MAX_CONCURRENCY`` per actor); the engine's
lock guards the bookkeeping and one ``Scheduler`` loop owns the model: it batches every running
request's forwards (continuous batching, chunked prefill, fair between tenants). Each tenant
may run at most ``max_concurrent_requests`` requests at once on a worker (default a quarter of the
slots; over it: ``tenant_busy``, retryable), so one tenant's queue cannot fill every slot. A failing or
cancelled request releases its blocks in ``finally`` and leaves the pool intact (``check_integrity``
holds after every call).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from cachecore.engine import CacheEngine, Tag
from cachecore.errors import CacheError, Cancelled, InvalidKV, TenantBusy
from cachecore.events import EventLog
from cachecore.model.loader import LoadedModel, RevisionSpec, load_model
from cachecore.routing.hashes import namespace_fields, request_salt
from cachecore.runner import Finished, Generator, Prefilled, SamplingParams, TokenOut
from cachecore.scheduler import Scheduler
from workers.config import WorkerConfig
from workers.remote_tier import RemoteTier
from workers.router_stats import DecodeClock, router_section
from workers.stops import apply_stops

MAX_CONCURRENCY = 32  # concurrent requests per actor (threads); the scheduler batches their forwards
DEFAULT_TENANT_CONCURRENCY = MAX_CONCURRENCY // 4
RETRYABLE = frozenset({"revision_changed", "out_of_blocks", "inflight_limit", "tenant_busy"})
_CANCEL_MEMORY = 4096  # cancelled request ids remembered (a cancel may arrive before its request)


class RevisionChanged(CacheError):
    """The request's revision was rolled out from under it; retry to run on the new one."""

    code = "revision_changed"


@dataclass
class _Active:
    loaded: LoadedModel
    generator: Generator


def replica_id(deployment: str, replica: int) -> str:
    """``<deployment>:<replica index>:<boot id>``: the boot id is random per process start, so a
    restarted replica is a new id whose KV events start over (seq 1) from an empty cache."""
    return f"{deployment}:{int(replica)}:{secrets.token_hex(4)}"


class CacheWorker:
    """One model deployment: the active revision, one L1 engine, and revisions being rolled out."""

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
    ) -> None:
        self.deployment = deployment
        self.replica = int(replica)
        self.replica_id = replica_id(deployment, self.replica)
        self.events = EventLog(self.replica_id)  # KV events of every tier (kv_events, kv_snapshot)
        self.decode = DecodeClock()
        self.preset = preset
        cfg = config or WorkerConfig.from_env()
        if l1_mb is not None or l2_mb is not None:
            cfg = replace(cfg, l1_mb=cfg.l1_mb if l1_mb is None else l1_mb,
                          l2_mb=cfg.l2_mb if l2_mb is None else l2_mb)
        self.config = cfg
        # Ray pins OMP threads to the actor's CPU request (0 -> 1 thread); prefill wants every core.
        torch.set_num_threads(cfg.torch_threads or os.cpu_count() or 1)
        self.block_size = block_size
        loaded = load_model(deployment, preset, RevisionSpec(**revision), device=device, block_size=block_size)
        layout = loaded.layout
        num_blocks = max(64, cfg.blocks(cfg.l1_mb, layout.bytes_per_block))
        self.l3 = RemoteTier.build(cfg, layout)
        self.engine = CacheEngine(layout, num_blocks, loaded.model.device,
                                  config=cfg.engine(bytes_per_block=layout.bytes_per_block),
                                  l3=self.l3.store if self.l3 is not None else None, events=self.events)
        self.scheduler = Scheduler(self.engine, token_budget=cfg.token_budget, max_batch=cfg.max_batch)
        self.test_hooks = test_hooks
        self._active = _Active(loaded, self._generator(loaded))
        self._staged: dict[str, _Active] = {}
        self._aborting: set[str] = set()  # revisions whose running requests must stop now
        self._lock = threading.Lock()
        self._per_tenant: Counter[str] = Counter()  # running requests per tenant
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._running_ids: set[str] = set()
        self.counters: Counter[str] = Counter()  # cancelled, tenant_busy (reported by info/stats)

    def _generator(self, loaded: LoadedModel) -> Generator:
        return Generator(loaded.model, self.engine, loaded.tokenizer, model_name=self.deployment,
                         revision=loaded.revision.label, scheduler=self.scheduler,
                         prefill_chunk=self.config.prefill_chunk)

    # ------------------------------------------------------------------ introspection
    def info(self) -> dict:
        a = self._active.loaded
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
        snap = self.engine.snapshot()
        snap["worker"] = {"deployment": self.deployment, "revision": self._active.loaded.revision.label,
                          "cancelled": self.counters["cancelled"], "tenant_busy": self.counters["tenant_busy"]}
        snap["router"] = router_section(self.engine, self.decode)
        snap["kv_events"] = self.events.stats()
        return snap

    # ------------------------------------------------------------------ KV events (for routers)
    def kv_events(self, since_seq: int) -> dict:
        """KV event batches of this replica from ``since_seq`` on (inclusive: pass the next seq you
        expect, ``PrefixIndex.expected_seq``; 1 for everything still buffered): ``{"replica_id",
        "seq" (the last published), "gap", "batches": [EventBatch.to_dict()...]}``. ``gap`` True
        (no batches) means batch ``since_seq`` is no longer buffered: reconcile from
        ``kv_snapshot()``. Raises ``ValueError`` for a ``since_seq`` that is not an int >= 1."""
        if isinstance(since_seq, bool) or not isinstance(since_seq, int) or since_seq < 1:
            raise ValueError(f"since_seq must be an int >= 1, got {since_seq!r}")
        batches, gap = self.events.since(since_seq - 1)
        return {"replica_id": self.replica_id, "seq": self.events.seq, "gap": gap,
                "batches": [b.to_dict() for b in batches]}

    def kv_snapshot(self) -> dict:
        """Every tier's block hashes (hex) as of ``seq``: ``{"replica_id", "seq", "tiers"}``."""
        return self.events.snapshot()

    def check_integrity(self) -> bool:
        self.engine.check_integrity()
        return True

    # ------------------------------------------------------------------ serving
    def stream(self, req: dict) -> Iterator[dict]:
        """Serve one request. ``req``: ``tenant`` (id), ``scope_salt`` (32 bytes, server-chosen),
        ``cache_salt`` (optional str), ``prompt`` (token ids: the control plane tokenizes and renders
        chat templates, so limits and quotas are checked before a worker is involved), ``max_tokens``,
        ``temperature``, ``seed``, ``logprobs``, ``max_cached_tokens`` (tenant cap or None),
        ``expected_revision`` (optional: fail with ``revision_changed`` if another is active),
        ``request_id`` (optional: ``cancel`` stops it), ``max_inflight_tokens`` and
        ``max_concurrent_requests`` (tenant bounds or None for the defaults), ``stop`` (optional: a
        string or up to 4; see ``workers.stops``: token texts are decoded incrementally and generation
        ends at a stop sequence, which is not returned).
        Yields plain-dict events: ``prefilled``, ``token``..., then ``finished`` or ``error``."""
        tenant = str(req["tenant"])
        rid = req.get("request_id")
        limit = req.get("max_concurrent_requests") or DEFAULT_TENANT_CONCURRENCY
        with self._lock:
            busy = self._per_tenant[tenant] >= limit
            if not busy:
                self._per_tenant[tenant] += 1
                if rid is not None:
                    self._running_ids.add(rid)
        if busy:
            self.counters["tenant_busy"] += 1
            yield self._error(TenantBusy("this tenant already runs its limit of concurrent requests; retry shortly"))
            return
        try:
            active = self._active  # one revision's tokenizer decodes what its model generates
            yield from apply_stops(self._stream(req, tenant, rid, active), active.loaded.tokenizer, req.get("stop"))
        finally:
            with self._lock:
                self._per_tenant[tenant] -= 1
                if not self._per_tenant[tenant]:
                    del self._per_tenant[tenant]
                if rid is not None:
                    self._cancelled.pop(rid, None)
                    self._running_ids.discard(rid)

    def _learn(self, tenant: str, req: dict) -> None:
        """The tenant's wrapped data keys and retention, as the control plane sent them (for L3)."""
        if self.l3 is not None:
            self.l3.learn(tenant, req.get("data_key"), req.get("retention_seconds"))
            self.l3.store.set_tenant_limit(tenant, req.get("max_l3_bytes"))

    def drop_data_key(self, req: dict) -> dict:
        """Crypto-shred ``{"tenant", "version"}`` on this worker: the key leaves memory at once, then
        that version's L3 objects are deleted. ``{"objects", "bytes"}``. Idempotent."""
        if self.l3 is None:
            return {"objects": 0, "bytes": 0}
        return self.l3.drop(str(req["tenant"]), int(req["version"]))

    @staticmethod
    def _error(exc: CacheError) -> dict:
        return {"type": "error", "code": exc.code, "message": str(exc), "retryable": exc.code in RETRYABLE}

    def _stream(self, req: dict, tenant: str, rid: str | None, active: _Active) -> Iterator[dict]:
        revision = active.loaded.revision.label
        try:
            if req.get("expected_revision") not in (None, revision):
                raise RevisionChanged(f"revision {req['expected_revision']} is no longer active; retry")
            tokens = req.get("prompt")
            self._learn(tenant, req)
            self.engine.set_tenant_cap(tenant, req.get("max_cached_tokens"))
            self.engine.set_inflight_limit(tenant, req.get("max_inflight_tokens"))
            ns = active.loaded.namespace(req["scope_salt"])
            params = SamplingParams(
                max_tokens=int(req.get("max_tokens", 16)),
                temperature=float(req.get("temperature") or 0.0),
                seed=req.get("seed"),
                logprobs=req.get("logprobs"),
            )
            events = active.generator.stream(
                ns, tokens, owner=tenant, params=params, request_salt=request_salt(req.get("cache_salt")),
                use_cache=req.get("use_cache", True), persist=bool(req.get("persist", True)),
                retention_seconds=self.l3.retention(tenant) if self.l3 is not None else None,
                should_abort=lambda: revision in self._aborting or (rid is not None and rid in self._cancelled),
            )
            resumed = None  # when the consumer handed control back after the last token
            for ev in events:
                if isinstance(ev, Prefilled):
                    yield {"type": "prefilled", "prompt_tokens": ev.prompt_tokens,
                           "cached_tokens": ev.cached_tokens, "revision": revision}
                elif isinstance(ev, TokenOut):
                    if resumed is not None:  # one decode step (its wait for the model included)
                        self.decode.observe(time.perf_counter() - resumed)
                    yield {"type": "token", "id": ev.token_id, "text": ev.text, "logprob": ev.logprob,
                           "top_logprobs": ev.top_logprobs}
                    resumed = time.perf_counter()
                elif isinstance(ev, Finished):
                    if ev.finish_reason == "aborted":
                        if rid is not None and rid in self._cancelled:
                            self.counters["cancelled"] += 1
                            raise Cancelled("the request was cancelled")
                        raise RevisionChanged(f"revision {revision} was replaced while this request ran; retry")
                    yield {"type": "finished", "finish_reason": ev.finish_reason, "revision": revision,
                           "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                                     "total_tokens": ev.prompt_tokens + ev.completion_tokens,
                                     "cached_tokens": ev.cached_tokens}}
        except CacheError as exc:
            yield self._error(exc)

    def cancel(self, request_id: str) -> bool:
        """Stop the request ``request_id`` at its next chunk or token (its client went away); its
        blocks are released. Remembered for a while, so a cancel that overtakes its request works too.
        Returns whether such a request is running now."""
        with self._lock:
            self._cancelled[str(request_id)] = None
            while len(self._cancelled) > _CANCEL_MEMORY:
                self._cancelled.popitem(last=False)
            return str(request_id) in self._running_ids

    def collect(self, req: dict) -> list[dict]:
        """All events of ``stream`` at once (one round trip for non-streaming API calls)."""
        return list(self.stream(req))

    def complete(self, req: dict) -> dict:
        """Non-streaming form of ``stream``: one dict with text, tokens, logprobs and usage (or error)."""
        out: dict = {"token_ids": [], "text": "", "logprobs": [], "top_logprobs": []}
        for ev in self.stream(req):
            if ev["type"] == "token":
                out["token_ids"].append(ev["id"])
                out["text"] += ev["text"]
                if ev["logprob"] is not None:
                    out["logprobs"].append(ev["logprob"])
                if ev["top_logprobs"] is not None:
                    out["top_logprobs"].append(ev["top_logprobs"])
            elif ev["type"] in ("finished", "error"):
                out.update(ev)
        return out

    # ------------------------------------------------------------------ KV API for external engines
    def kv_layout(self) -> dict:
        a = self._active.loaded
        layout = a.layout
        return {**layout.canonical(), "page_shape": list(layout.page_shape),
                "bytes_per_block": layout.bytes_per_block, "vocab_size": a.config.vocab_size,
                "max_seq_len": a.config.max_seq_len}

    # KV uploaded through the API is untrusted (origin "upload"): keyed under the uploading tenant's own
    # salt (never its share group's) and read back only by the KV API, never by a completion. KV the
    # model computed (origin "model", the tenant's scope) can be looked up and retrieved as well.
    def _kv_namespaces(self, req: dict):
        a = self._active.loaded
        return a.namespace(req["scope_salt"]), a.namespace(req["tenant_salt"], origin="upload")

    def _kv_tokens(self, req: dict) -> list[int]:
        config = self._active.loaded.config
        tokens = req.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidKV("tokens must be a list of token ids")
        if len(tokens) > config.max_seq_len:
            raise InvalidKV(f"{len(tokens)} tokens exceed the model's context length of {config.max_seq_len}")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < config.vocab_size:
                raise InvalidKV(f"token ids must be integers in [0, {config.vocab_size})")
        return tokens

    def kv_lookup(self, req: dict) -> dict:
        """``{"hit_tokens", "origin"}``: the longer contiguous hit of the model's KV and the tenant's uploads."""
        tokens = self._kv_tokens(req)
        salt = request_salt(req.get("cache_salt"))
        best = {"hit_tokens": 0, "origin": None}
        for ns in self._kv_namespaces(req):
            hit = self.engine.lookup(ns, tokens, request_salt=salt)
            if hit > best["hit_tokens"]:
                best = {"hit_tokens": hit, "origin": ns.origin}
        return best

    def kv_store(self, req: dict, kv: torch.Tensor) -> int:
        """Store untrusted KV for the full blocks of ``tokens`` under the tenant's upload namespace.
        Raises ``InvalidKV`` unless ``kv`` has exactly the layout's shape and dtype and only finite
        values. Counts against the tenant's cap like any cached block."""
        tokens = self._kv_tokens(req)
        layout = self._active.loaded.layout
        n_blocks = len(tokens) // self.block_size
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (n_blocks, *layout.page_shape):
            raise InvalidKV(f"kv must have shape [{n_blocks}, {', '.join(map(str, layout.page_shape))}]")
        if kv.dtype != layout.torch_dtype:
            raise InvalidKV(f"kv must be {layout.dtype}")
        if n_blocks and not bool(torch.isfinite(kv).all()):
            raise InvalidKV("kv holds NaN or infinite values")
        tenant = str(req["tenant"])
        self.engine.set_tenant_cap(tenant, req.get("max_cached_tokens"))
        _, upload_ns = self._kv_namespaces(req)
        return self.engine.store(upload_ns, tokens, kv, owner=tenant, request_salt=request_salt(req.get("cache_salt")),
                                 model=self.deployment, revision=self._active.loaded.revision.label)

    def kv_retrieve(self, req: dict) -> tuple[torch.Tensor, torch.Tensor, str | None]:
        """KV of the longer contiguous hit (model or the tenant's uploads), its mask and origin."""
        tokens = self._kv_tokens(req)
        found = self.kv_lookup(req)
        if not found["hit_tokens"]:
            layout = self._active.loaded.layout
            empty = torch.empty((0, *layout.page_shape), dtype=layout.torch_dtype)
            return empty, torch.zeros(len(tokens), dtype=torch.bool), None
        model_ns, upload_ns = self._kv_namespaces(req)
        ns = upload_ns if found["origin"] == "upload" else model_ns
        kv, mask = self.engine.retrieve(ns, tokens, request_salt=request_salt(req.get("cache_salt")))
        return kv.cpu(), mask, ns.origin

    # ------------------------------------------------------------------ operations (flush, rollout)
    @staticmethod
    def _matcher(scope: dict):
        kind = scope.get("scope")
        if kind == "tenant":
            tenant = str(scope["tenant"])
            return lambda t: t.owner == tenant
        if kind == "revision":
            return lambda t: t.revision == scope["revision"]
        if kind in ("model", "all"):
            return lambda t: True
        raise ValueError(f"unknown flush scope {kind!r}")

    def _l3_scope(self, scope: dict) -> dict:
        kind = scope.get("scope")
        if kind == "tenant":
            return {"tenant": str(scope["tenant"])}
        if kind == "key_version":
            return {"tenant": str(scope["tenant"]), "key_version": int(scope["version"])}
        if kind == "revision":
            return {"model": self.deployment, "revision": scope["revision"]}
        return {"model": self.deployment}

    def flush(self, scope: dict) -> dict:
        """Drop cached blocks in ``scope`` (``{"scope": "tenant", "tenant": id}``, revision, model, all)
        in every tier, L3 objects included. Idempotent: a second call frees nothing more."""
        t0 = time.perf_counter()
        if scope.get("scope") == "key_version":  # a shred flushes only L3 objects of that version
            result = {"blocks_freed": 0, "tokens_dropped": 0, "tiers": {"l1": 0, "l2": 0, "l3": 0}, "l3_bytes": 0}
            if self.l3 is not None:
                n, b = self.l3.store.delete_scope(**self._l3_scope(scope))
                result["tiers"]["l3"], result["l3_bytes"] = n, b
        else:
            result = self.engine.flush(self._matcher(scope), l3_scope=self._l3_scope(scope))
        result["seconds"] = round(time.perf_counter() - t0, 6)
        result["bytes"] = (result["tiers"]["l1"] + result["tiers"]["l2"]) * self.engine.layout.bytes_per_block \
            + result.get("l3_bytes", 0)
        return result

    def probe(self, scope: dict) -> dict:
        """Verification after a flush or shred: cached blocks (L3: objects) left in ``scope`` in any
        tier (0 means it misses everywhere)."""
        if scope.get("scope") == "key_version":
            remaining = self.l3.store.count_scope(**self._l3_scope(scope))[0] if self.l3 is not None else 0
        else:
            remaining = self.engine.count_cached(self._matcher(scope), l3_scope=self._l3_scope(scope))
        return {"remaining_blocks": remaining, "ok": remaining == 0}

    def stage_revision(self, revision: dict) -> dict:
        """Load a new revision's weights beside the active one (no effect on serving yet)."""
        spec = RevisionSpec(**revision)
        loaded = load_model(self.deployment, self.preset, spec, device=str(self.engine.pages.device),
                            block_size=self.block_size)
        with self._lock:
            self._staged[spec.label] = _Active(loaded, self._generator(loaded))
        return {"revision": spec.label, "weight_digest": loaded.weight_digest}

    def switch_revision(self, label: str, *, drain_seconds: float = 10.0) -> dict:
        """Rollout: stop hits for the old revision, switch atomically, drain the old revision's running
        requests until the deadline, abort the rest (retryable error), then free the old pages."""
        with self._lock:
            if self._active.loaded.revision.label == label:
                return {"switched": False, "revision": label, "aborted": 0, "blocks_freed": 0}
            new = self._staged.pop(label, None)
            if new is None:
                raise ValueError(f"revision {label!r} is not staged on this worker")
            old = self._active.loaded.revision.label
            retired = self.engine.retire(self.deployment, old)  # no more hits or stores for the old namespace
            self.engine.unretire(self.deployment, label)  # a rollback to an earlier label caches again
            self._active = new  # new requests now run on the new revision
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and self._running_of(old):
            time.sleep(0.01)
        aborted = len(self._running_of(old))
        if aborted:
            self._aborting.add(old)
            while self._running_of(old):
                time.sleep(0.01)
            self._aborting.discard(old)
        freed = self.engine.flush(lambda t: t.revision == old)  # anything registered while draining
        self.engine.check_integrity()
        return {"switched": True, "from": old, "revision": label, "aborted": aborted,
                "blocks_freed": retired["blocks_freed"] + freed["blocks_freed"]}

    def _running_of(self, revision: str) -> list:
        return [s for s in self.engine.running() if s.tag.revision == revision]

    def poison_free_blocks(self) -> int:
        """Test hook: fill every unheld block with NaN, so any read of a freed page shows in outputs.
        Refused unless the worker was built with ``test_hooks=True`` (never in production)."""
        if not self.test_hooks:
            raise PermissionError("test hooks are disabled on this worker")
        with self.engine._lock:
            ids = [b.block_id for b in self.engine.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
            self.engine.pages.poison(torch.tensor(ids, dtype=torch.long))
            return len(ids)


__all__ = ["CacheWorker", "RevisionChanged", "Tag", "request_salt"]
