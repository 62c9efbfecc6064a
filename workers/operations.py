"""Operations on a cache worker: flush and probe (jobs), staging and switching revisions (rollout),
and the test-only page poisoning hook.

A mixin of :class:`workers.cache_worker.CacheWorker` (it uses the worker's engine, L3 tier, lock and
revision state).
"""

from __future__ import annotations

import time

import torch

from cachecore.model.hf_config import weights_root
from cachecore.model.loader import RevisionSpec, load_model


class OperationsMixin:
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
        if kind == "tenant_l3":
            return {"tenant": str(scope["tenant"])}
        if kind == "revision":
            return {"model": self.deployment, "revision": scope["revision"]}
        return {"model": self.deployment}

    def flush(self, scope: dict) -> dict:
        """Drop cached blocks in ``scope`` (``{"scope": "tenant", "tenant": id}``, revision, model, all)
        in every tier, L3 objects included. L3 only: ``key_version`` (a shred), ``tenant_l3`` (the
        tenant turned persistence off: every L3 object of it; L1/L2 keep serving it) and
        ``l3_expire`` (``{"tenant", "retention_seconds"}``: the tenant's retention was lowered; it
        applies on this worker from now on, and what is now too old is deleted). Idempotent: a second
        call frees nothing more."""
        t0 = time.perf_counter()
        if scope.get("scope") == "l3_expire":
            result = {"blocks_freed": 0, "tokens_dropped": 0, "tiers": {"l1": 0, "l2": 0, "l3": 0}, "l3_bytes": 0}
            if self.l3 is not None:
                n, b = self.l3.expire(str(scope["tenant"]), int(scope["retention_seconds"]))
                result["tiers"]["l3"], result["l3_bytes"] = n, b
        elif scope.get("scope") in ("key_version", "tenant_l3"):  # only L3 objects of the scope
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
        if scope.get("scope") == "l3_expire":
            remaining = (self.l3.store.count_expired(tenant=str(scope["tenant"]),
                                                     retention_seconds=int(scope["retention_seconds"]))
                         if self.l3 is not None else 0)
        elif scope.get("scope") in ("key_version", "tenant_l3"):
            remaining = self.l3.store.count_scope(**self._l3_scope(scope))[0] if self.l3 is not None else 0
        else:
            remaining = self.engine.count_cached(self._matcher(scope), l3_scope=self._l3_scope(scope))
        return {"remaining_blocks": remaining, "ok": remaining == 0}

    def stage_revision(self, revision: dict) -> dict:
        """Load a new revision's weights beside the active one (no effect on serving yet)."""
        spec = RevisionSpec(**revision)
        with weights_root(self.config.weights_root):
            loaded = load_model(self.deployment, self.preset, spec, device=str(self.engine.pages.device),
                                block_size=self.block_size, dtype=self.dtype)
        with self._lock:
            self._staged[spec.label] = self._bundle(loaded)
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
        tiers = {t: retired["tiers"][t] + freed["tiers"][t] for t in ("l1", "l2", "l3")}
        l3_bytes = retired["l3_bytes"] + freed["l3_bytes"]
        return {"switched": True, "from": old, "revision": label, "aborted": aborted,
                "blocks_freed": retired["blocks_freed"] + freed["blocks_freed"], "tiers": tiers,
                "l3_bytes": l3_bytes,
                "bytes": (tiers["l1"] + tiers["l2"]) * self.engine.layout.bytes_per_block + l3_bytes}

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
