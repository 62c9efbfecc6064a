"""CacheWorker: the plain class behind each Ray actor. Owns one model deployment's cache and model.

It never touches a database: the control plane resolves the tenant, its scope salt and the model's
active revision, and hands them in with each request. All inputs and outputs are plain data (dicts,
lists, bytes) so the same calls work in-process (tests) and through Ray.

Concurrency: many requests may stream at once (threads); the engine's lock guards the bookkeeping and
the generator serialises model forwards. A failing request releases its blocks in ``finally`` and
leaves the pool intact (``check_integrity`` holds after every call).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cachecore.engine import CacheEngine, Tag
from cachecore.errors import CacheError
from cachecore.model.loader import LoadedModel, RevisionSpec, load_model
from cachecore.runner import Finished, Generator, Prefilled, SamplingParams, TokenOut

DEFAULT_L1_MB = int(os.environ.get("STRATA_L1_MB", "256"))


class RevisionChanged(CacheError):
    """The request's revision was rolled out from under it; retry to run on the new one."""

    code = "revision_changed"


@dataclass
class _Active:
    loaded: LoadedModel
    generator: Generator


def request_salt(cache_salt: str | None) -> bytes:
    """A client's ``cache_salt`` narrows sharing inside its scope; it never replaces the scope salt."""
    if not cache_salt:
        return b""
    return hashlib.sha256(b"strata.cache_salt\x00" + cache_salt.encode()).digest()


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
        block_size: int = 16,
    ) -> None:
        self.deployment = deployment
        self.preset = preset
        # Ray pins OMP threads to the actor's CPU request (0 -> 1 thread); prefill wants every core.
        torch.set_num_threads(int(os.environ.get("STRATA_TORCH_THREADS") or os.cpu_count() or 1))
        self.block_size = block_size
        loaded = load_model(deployment, preset, RevisionSpec(**revision), device=device, block_size=block_size)
        layout = loaded.layout
        num_blocks = max(64, (l1_mb or DEFAULT_L1_MB) * 2**20 // layout.bytes_per_block)
        self.engine = CacheEngine(layout, num_blocks, loaded.model.device)
        self._active = _Active(loaded, self._generator(loaded))
        self._staged: dict[str, _Active] = {}
        self._aborting: set[str] = set()  # revisions whose running requests must stop now
        self._lock = threading.Lock()

    def _generator(self, loaded: LoadedModel) -> Generator:
        return Generator(loaded.model, self.engine, loaded.tokenizer, model_name=self.deployment,
                         revision=loaded.revision.label)

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
            "layout": a.layout.canonical(),
            "vocab_size": a.config.vocab_size,
            "max_seq_len": a.config.max_seq_len,
            "running": len(self.engine.running()),
        }

    def ping(self) -> bool:
        return True

    def stats(self) -> dict:
        snap = self.engine.snapshot()
        snap["worker"] = {"deployment": self.deployment, "revision": self._active.loaded.revision.label}
        return snap

    def check_integrity(self) -> bool:
        self.engine.check_integrity()
        return True

    # ------------------------------------------------------------------ serving
    def stream(self, req: dict) -> Iterator[dict]:
        """Serve one request. ``req``: ``tenant`` (id), ``scope_salt`` (32 bytes, server-chosen),
        ``cache_salt`` (optional str), ``prompt`` (token ids: the control plane tokenizes and renders
        chat templates, so limits and quotas are checked before a worker is involved), ``max_tokens``,
        ``temperature``, ``seed``, ``logprobs``, ``max_cached_tokens`` (tenant cap or None),
        ``expected_revision`` (optional: fail with ``revision_changed`` if another is active).
        Yields plain-dict events: ``prefilled``, ``token``..., then ``finished`` or ``error``."""
        active = self._active
        revision = active.loaded.revision.label
        try:
            if req.get("expected_revision") not in (None, revision):
                raise RevisionChanged(f"revision {req['expected_revision']} is no longer active; retry")
            tokens = req.get("prompt")
            tenant = str(req["tenant"])
            self.engine.set_tenant_cap(tenant, req.get("max_cached_tokens"))
            ns = active.loaded.namespace(req["scope_salt"])
            params = SamplingParams(
                max_tokens=int(req.get("max_tokens", 16)),
                temperature=float(req.get("temperature") or 0.0),
                seed=req.get("seed"),
                logprobs=req.get("logprobs"),
            )
            events = active.generator.stream(
                ns, tokens, owner=tenant, params=params, request_salt=request_salt(req.get("cache_salt")),
                use_cache=req.get("use_cache", True), should_abort=lambda: revision in self._aborting,
            )
            for ev in events:
                if isinstance(ev, Prefilled):
                    yield {"type": "prefilled", "prompt_tokens": ev.prompt_tokens,
                           "cached_tokens": ev.cached_tokens, "revision": revision}
                elif isinstance(ev, TokenOut):
                    yield {"type": "token", "id": ev.token_id, "text": ev.text, "logprob": ev.logprob,
                           "top_logprobs": ev.top_logprobs}
                elif isinstance(ev, Finished):
                    if ev.finish_reason == "aborted":
                        raise RevisionChanged(f"revision {revision} was replaced while this request ran; retry")
                    yield {"type": "finished", "finish_reason": ev.finish_reason, "revision": revision,
                           "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                                     "total_tokens": ev.prompt_tokens + ev.completion_tokens,
                                     "cached_tokens": ev.cached_tokens}}
        except CacheError as exc:
            yield {"type": "error", "code": exc.code, "message": str(exc),
                   "retryable": isinstance(exc, RevisionChanged) or exc.code == "out_of_blocks"}

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
        layout = self._active.loaded.layout
        return {**layout.canonical(), "page_shape": list(layout.page_shape),
                "bytes_per_block": layout.bytes_per_block}

    def kv_lookup(self, req: dict) -> int:
        ns = self._active.loaded.namespace(req["scope_salt"])
        return self.engine.lookup(ns, req["tokens"], request_salt=request_salt(req.get("cache_salt")))

    def kv_store(self, req: dict, kv: torch.Tensor) -> int:
        a = self._active.loaded
        self.engine.set_tenant_cap(str(req["tenant"]), req.get("max_cached_tokens"))
        return self.engine.store(a.namespace(req["scope_salt"]), req["tokens"], kv, owner=str(req["tenant"]),
                                 request_salt=request_salt(req.get("cache_salt")), model=self.deployment,
                                 revision=a.revision.label)

    def kv_retrieve(self, req: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ns = self._active.loaded.namespace(req["scope_salt"])
        kv, mask = self.engine.retrieve(ns, req["tokens"], request_salt=request_salt(req.get("cache_salt")))
        return kv.cpu(), mask

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

    def flush(self, scope: dict) -> dict:
        """Drop cached blocks in ``scope`` (``{"scope": "tenant", "tenant": id}``, revision, model, all).
        Idempotent: a second call frees nothing more."""
        t0 = time.perf_counter()
        result = self.engine.flush(self._matcher(scope))
        result["seconds"] = round(time.perf_counter() - t0, 6)
        result["bytes"] = result["blocks_freed"] * self.engine.layout.bytes_per_block
        return result

    def probe(self, scope: dict) -> dict:
        """Verification after a flush: how many cached blocks in ``scope`` remain (0 means it misses)."""
        remaining = self.engine.count_cached(self._matcher(scope))
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
        """Test hook: fill every unheld block with NaN, so any read of a freed page shows in outputs."""
        with self.engine._lock:
            ids = [b.block_id for b in self.engine.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
            self.engine.pages.poison(torch.tensor(ids, dtype=torch.long))
            return len(ids)


__all__ = ["CacheWorker", "RevisionChanged", "Tag", "request_salt"]
