"""The KV API of a ``CacheWorker`` (Strata's engine), for external inference engines (``/v1/kv/...``);
``workers.vllm_kv_api.VllmKVApi`` is the vLLM replica's, behind the same worker methods.

KV uploaded through the API is untrusted (origin ``upload``): keyed under the uploading tenant's own
salt (never its share group's) and read back only by the KV API, never by a completion. KV the model
computed (origin ``model``, the tenant's scope) can be looked up and retrieved as well.

Every call (lookup, store, retrieve) holds one of the tenant's concurrent-request slots while it runs
(``RequestSlots.slot``: ``req["max_concurrent_requests"]``, the same count completions use), so a
tenant capped at N requests runs at most N KV calls and completions together (``tenant_busy``, 429).

:class:`StrataKVApi`'s collaborators: the worker's ``CacheEngine`` (``lookup`` / ``store`` /
``retrieve``, caps and weights), its ``Scheduler`` (uploads run as its work), its ``RevisionManager``
(the active revision: layout, vocabulary and context length, namespaces), its ``RequestSlots``, the
deployment's name and block size.
"""

from __future__ import annotations

import torch

from cachecore.errors import InvalidKV
from cachecore.routing.hashes import request_salt
from workers.admission import RequestSlots
from workers.revisions import RevisionManager


def _weight(share_weight: int | None) -> int:
    """``None`` is an equal share (1); any other value is used as given, so 0 is refused, never 1."""
    return 1 if share_weight is None else share_weight


class StrataKVApi:
    """``layout``, ``lookup``, ``store``, ``retrieve`` of one ``CacheWorker`` (module docstring)."""

    def __init__(self, engine, *, scheduler, revisions: RevisionManager, slots: RequestSlots, deployment: str,
                 block_size: int) -> None:
        self.engine, self.scheduler, self.revisions, self.slots = engine, scheduler, revisions, slots
        self.deployment, self.block_size = deployment, block_size

    def layout(self) -> dict:
        a = self.revisions.active.loaded
        layout = a.layout
        return {**layout.canonical(), "page_shape": list(layout.page_shape),
                "bytes_per_block": layout.bytes_per_block, "vocab_size": a.config.vocab_size,
                "max_seq_len": a.config.max_seq_len}

    def _namespaces(self, req: dict):
        """(the model's KV in the tenant's scope, the tenant's own uploads)."""
        a = self.revisions.active.loaded
        return a.namespace(req["scope_salt"]), a.namespace(req["tenant_salt"], origin="upload")

    def _tokens(self, req: dict) -> list[int]:
        config = self.revisions.active.loaded.config
        tokens = req.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidKV("tokens must be a list of token ids")
        if len(tokens) > config.max_seq_len:
            raise InvalidKV(f"{len(tokens)} tokens exceed the model's context length of {config.max_seq_len}")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < config.vocab_size:
                raise InvalidKV(f"token ids must be integers in [0, {config.vocab_size})")
        return tokens

    def lookup(self, req: dict) -> dict:
        """``{"hit_tokens", "origin"}``: the longer contiguous hit of the model's KV and the tenant's uploads."""
        with self.slots.slot(req):
            return self._lookup(req)

    def _lookup(self, req: dict) -> dict:
        tokens = self._tokens(req)
        salt = request_salt(req.get("cache_salt"))
        best = {"hit_tokens": 0, "origin": None}
        for ns in self._namespaces(req):
            hit = self.engine.lookup(ns, tokens, request_salt=salt)
            if hit > best["hit_tokens"]:
                best = {"hit_tokens": hit, "origin": ns.origin}
        return best

    def store(self, req: dict, kv: torch.Tensor) -> int:
        """Store untrusted KV for the full blocks of ``tokens`` under the tenant's upload namespace.
        Raises ``InvalidKV`` unless ``kv`` has exactly the layout's shape and dtype and only finite
        values. Counts against the tenant's cap like any cached block. The value check and the page writes
        run on the scheduler's loop between forwards (``Scheduler.submit_work``), charged to the tenant."""
        with self.slots.slot(req):
            return self._store(req, kv)

    def _store(self, req: dict, kv: torch.Tensor) -> int:
        tokens = self._tokens(req)
        layout = self.revisions.active.loaded.layout
        n_blocks = len(tokens) // self.block_size
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (n_blocks, *layout.page_shape):
            raise InvalidKV(f"kv must have shape [{n_blocks}, {', '.join(map(str, layout.page_shape))}]")
        if kv.dtype != layout.torch_dtype:
            raise InvalidKV(f"kv must be {layout.dtype}")
        tenant = str(req["tenant"])
        _, upload_ns = self._namespaces(req)
        revision = self.revisions.active.label

        def store() -> int:
            if n_blocks and not bool(torch.isfinite(kv).all()):
                raise InvalidKV("kv holds NaN or infinite values")
            self.engine.set_tenant_cap(tenant, req.get("max_cached_tokens"))
            self.engine.set_weight(tenant, req.get("share_weight"))
            return self.engine.store(upload_ns, tokens, kv, owner=tenant, model=self.deployment, revision=revision,
                                     request_salt=request_salt(req.get("cache_salt")))

        # the value scan and page writes run on the scheduler's loop between two forwards, charged to the
        # tenant as the tokens they cover, so an uploader waits behind a tenant below its share (scheduler/work.py)
        work = self.scheduler.submit_work(tenant, n_blocks * self.block_size, store,
                                          weight=_weight(req.get("share_weight")))
        return work.result()

    def retrieve(self, req: dict) -> tuple[torch.Tensor, torch.Tensor, str | None]:
        """KV of the longer contiguous hit (model or the tenant's uploads), its mask and origin."""
        with self.slots.slot(req):
            return self._retrieve(req)

    def _retrieve(self, req: dict) -> tuple[torch.Tensor, torch.Tensor, str | None]:
        tokens = self._tokens(req)
        found = self._lookup(req)
        if not found["hit_tokens"]:
            layout = self.revisions.active.loaded.layout
            empty = torch.empty((0, *layout.page_shape), dtype=layout.torch_dtype)
            return empty, torch.zeros(len(tokens), dtype=torch.bool), None
        model_ns, upload_ns = self._namespaces(req)
        ns = upload_ns if found["origin"] == "upload" else model_ns
        kv, mask = self.engine.retrieve(ns, tokens, request_salt=request_salt(req.get("cache_salt")))
        return kv.cpu(), mask, ns.origin
