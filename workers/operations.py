"""Operations on a ``CacheWorker``'s cache: flush and probe (jobs), a data key's crypto-shred, the
integrity check, waiting for tier writes, and the test-only page poisoning hook.

:class:`Operations` has no state of its own. Its collaborators: the worker's ``CacheEngine`` (public
methods only: ``flush``, ``count_cached``, ``check_integrity``, ``drain_writes``, ``poison_free_pages``,
``layout``), its L3 (``workers.worker_l3.WorkerL3`` or None), the deployment's name (L3 scopes) and
whether test hooks are on.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from workers.worker_l3 import WorkerL3

_L3_ONLY = ("key_version", "tenant_l3")  # scopes whose flush deletes L3 objects only


def _matcher(scope: dict) -> Callable:
    """The blocks (by their ``Tag``) a flush of ``scope`` drops from L1 and L2."""
    kind = scope.get("scope")
    if kind == "tenant":
        tenant = str(scope["tenant"])
        return lambda t: t.owner == tenant
    if kind == "revision":
        return lambda t: t.revision == scope["revision"]
    if kind in ("model", "all"):
        return lambda t: True
    raise ValueError(f"unknown flush scope {kind!r}")


def _older_than(match: Callable, generation: int) -> Callable:
    """``match`` narrowed to blocks admitted before flush generation ``generation`` (``Tag.gen``)."""
    return lambda t: t.gen < generation and match(t)


def l3_scope(scope: dict, deployment: str) -> dict:
    """The L3 objects (``RemoteStore.delete_scope`` / ``count_scope`` filters) of ``scope``."""
    kind = scope.get("scope")
    if kind in ("tenant", "tenant_l3"):
        return {"tenant": str(scope["tenant"])}
    if kind == "key_version":
        return {"tenant": str(scope["tenant"]), "key_version": int(scope["version"])}
    if kind == "revision":
        return {"model": deployment, "revision": scope["revision"]}
    return {"model": deployment}


class Operations:
    """Flush, probe, shreds, integrity, drains and the poisoning hook of one ``CacheWorker`` (module docstring)."""

    def __init__(self, engine, *, l3: WorkerL3 | None, deployment: str, test_hooks: bool = False) -> None:
        self.engine, self.l3, self.deployment, self.test_hooks = engine, l3, deployment, test_hooks
        self.instance = secrets.token_hex(8)  # this process's engine: a flush's generation is its own

    def flush(self, scope: dict) -> dict:
        """Drop cached blocks in ``scope`` (``{"scope": "tenant", "tenant": id}``, revision, model, all)
        in every tier, L3 objects included. L3 only: ``key_version`` (a shred), ``tenant_l3`` (the
        tenant turned persistence off: every L3 object of it; L1/L2 keep serving it) and
        ``l3_expire`` (``{"tenant", "retention_seconds"}``: the tenant's retention was lowered; it
        applies on this worker from now on, and what is now too old is deleted). Idempotent: a second
        call frees nothing more."""
        t0 = time.perf_counter()
        started = time.time()
        kind = scope.get("scope")
        if kind == "l3_expire" or kind in _L3_ONLY:
            result = {"blocks_freed": 0, "tokens_dropped": 0, "tiers": {"l1": 0, "l2": 0, "l3": 0}, "l3_bytes": 0}
            if self.l3 is not None:
                if kind == "l3_expire":
                    n, b = self.l3.expire(str(scope["tenant"]), int(scope["retention_seconds"]))
                else:  # only L3 objects of the scope
                    n, b = self.l3.store.delete_scope(**l3_scope(scope, self.deployment))
                result["tiers"]["l3"], result["l3_bytes"] = n, b
        else:
            result = self.engine.flush(_matcher(scope), l3_scope=l3_scope(scope, self.deployment))
            # What its probe needs to tell what the flush left from what traffic cached since.
            result["since"] = {"instance": self.instance, "generation": result.pop("generation"), "at": started}
        result["seconds"] = round(time.perf_counter() - t0, 6)
        result["bytes"] = (result["tiers"]["l1"] + result["tiers"]["l2"]) * self.engine.layout.bytes_per_block \
            + result.get("l3_bytes", 0)
        return result

    def probe(self, scope: dict) -> dict:
        """Verification after a flush or shred: cached blocks (L3: objects) left in ``scope`` in any
        tier (0 means it misses everywhere). With the flush's ``"since"`` (its result's), only what was
        cached before that flush counts: blocks of requests admitted at an older generation (none if
        this engine started after the flush: a new instance) and L3 objects written before it, so the
        scope's own traffic after the flush does not fail the verification."""
        kind = scope.get("scope")
        if kind == "l3_expire":
            remaining = (self.l3.store.count_expired(tenant=str(scope["tenant"]),
                                                     retention_seconds=int(scope["retention_seconds"]))
                         if self.l3 is not None else 0)
        elif kind in _L3_ONLY:
            remaining = self.l3.store.count_scope(**l3_scope(scope, self.deployment))[0] if self.l3 is not None else 0
        else:
            match, l3 = _matcher(scope), l3_scope(scope, self.deployment)
            since = scope.get("since")
            if isinstance(since, dict):
                before = int(since["generation"]) if since.get("instance") == self.instance else 0
                match = _older_than(match, before)
                l3 = {**l3, "written_before": float(since["at"])}
            remaining = self.engine.count_cached(match, l3_scope=l3)
        return {"remaining_blocks": remaining, "ok": remaining == 0}

    def drop_data_key(self, req: dict) -> dict:
        """Crypto-shred ``{"tenant", "version"}`` on this worker: the key leaves memory at once, then
        that version's L3 objects are deleted. ``{"objects", "bytes"}``. Idempotent."""
        if self.l3 is None:
            return {"objects": 0, "bytes": 0}
        return self.l3.drop(str(req["tenant"]), int(req["version"]))

    def check_integrity(self) -> bool:
        """Assert every tier's invariants (``AssertionError`` naming the first broken one); True."""
        self.engine.check_integrity()
        return True

    def drain_writes(self) -> None:
        """Wait until the tier writes queued so far have landed (tests, benchmarks)."""
        self.engine.drain_writes()

    def poison_free_blocks(self) -> int:
        """Test hook: fill every unheld block with NaN, so any read of a freed page shows in outputs.
        Refused unless the worker was built with ``test_hooks=True`` (never in production)."""
        if not self.test_hooks:
            raise PermissionError("test hooks are disabled on this worker")
        return self.engine.poison_free_pages()
