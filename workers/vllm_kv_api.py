"""The KV API (``/v1/kv/...``) of a vLLM deployment, over Strata's tiers behind vLLM
(``workers.kv_tiers``): the same contract as the reference engine's (``workers.kv_api``).

- ``kv_layout``: Strata's block layout of the engine's KV (``VllmRevision.kv_layout``; on vLLM's CPU
  backend the canonical ``[layers, 2, block, kv heads, head dim]``, the reference engine's).
- ``kv_lookup`` / ``kv_retrieve``: the longer contiguous hit in the tenant's scope, of the KV vLLM
  computed (origin ``model``: every full prompt block vLLM computes is written through to L2) or of
  the tenant's own uploads (origin ``upload``). vLLM's device pages are not read: L2 holds what the
  API serves.
- ``kv_store``: untrusted KV keyed under the uploading tenant's own salt and the ``upload`` origin,
  so no completion ever reaches it (completions key their blocks under the ``model`` origin); checked
  for shape, dtype and finite values here, stored in L2 only (never L3), counted against the
  tenant's cap and fair share like any cached block.

Every call holds one of the tenant's concurrent-request slots (``RequestSlots.slot``).
Tensors cross to the tier service as raw bytes.
"""

from __future__ import annotations

import torch

from cachecore.errors import InvalidKV, KVApiUnsupported
from cachecore.hashing import chain_hashes
from cachecore.routing.hashes import request_salt
from workers.kv_wire import from_wire, to_wire


class VllmKVApi:
    """The KV API of one ``VllmWorker`` (its active revision, tier service and tenant slots)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def _rev(self):
        rev = self.worker._active
        if rev.tiers is None:
            raise KVApiUnsupported("this vLLM deployment runs without Strata's tiers (STRATA_VLLM_CONNECTOR=0 "
                                   "or tensor parallelism): the KV API has nothing to serve")
        return rev

    def layout(self) -> dict:
        rev = self._rev()
        lay = rev.kv_layout()
        return {**lay.canonical(), "page_shape": list(lay.page_shape), "bytes_per_block": lay.bytes_per_block,
                "vocab_size": rev.facts.vocab_size, "max_seq_len": rev.facts.max_seq_len,
                "engine": "vllm", "pages": rev.layout()["pages"]}

    def _tokens(self, rev, req: dict) -> list[int]:
        tokens = req.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidKV("tokens must be a list of token ids")
        if len(tokens) > rev.facts.max_seq_len:
            raise InvalidKV(f"{len(tokens)} tokens exceed the model's context length of {rev.facts.max_seq_len}")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < rev.facts.vocab_size:
                raise InvalidKV(f"token ids must be integers in [0, {rev.facts.vocab_size})")
        return tokens

    def _keys(self, rev, req: dict, tokens: list[int]) -> list[tuple[str, list[bytes]]]:
        """(origin, block hashes) of the model's scope and of the tenant's own uploads."""
        dep, salt = self.worker.deployment, request_salt(req.get("cache_salt"))
        out = []
        for origin, scope in (("model", req["scope_salt"]), ("upload", req["tenant_salt"])):
            ns = rev.namespace(dep, scope, origin=origin)
            out.append((origin, chain_hashes(ns, tokens, rev.block_size, request_salt=salt)))
        return out

    def _lookup(self, rev, req: dict, tokens: list[int]) -> tuple[int, str | None, list[bytes]]:
        best = (0, None, [])
        for origin, hashes in self._keys(rev, req, tokens):
            n = self.worker._tiers("kv_lookup", rev, hashes=hashes, tokens=tokens)
            if n > best[0]:
                best = (n, origin, hashes)
        return best

    def lookup(self, req: dict) -> dict:
        with self.worker.slots.slot(req):
            rev = self._rev()
            n, origin, _ = self._lookup(rev, req, self._tokens(rev, req))
            return {"hit_tokens": n * rev.block_size, "origin": origin}

    def retrieve(self, req: dict) -> tuple[torch.Tensor, torch.Tensor, str | None]:
        with self.worker.slots.slot(req):
            rev = self._rev()
            tokens = self._tokens(rev, req)
            lay = rev.kv_layout()
            n, origin, hashes = self._lookup(rev, req, tokens)
            kv = torch.empty((0, *lay.page_shape), dtype=lay.torch_dtype)
            if n:
                kv = from_wire(self.worker._tiers("kv_retrieve", rev, hashes=hashes[:n], tokens=tokens))
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[: kv.shape[0] * rev.block_size] = True
            return kv, mask, origin if kv.shape[0] else None

    def store(self, req: dict, kv: torch.Tensor) -> int:
        with self.worker.slots.slot(req):
            rev = self._rev()
            tokens = self._tokens(rev, req)
            lay = rev.kv_layout()
            n_blocks = len(tokens) // rev.block_size
            if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (n_blocks, *lay.page_shape):
                raise InvalidKV(f"kv must have shape [{n_blocks}, {', '.join(map(str, lay.page_shape))}]")
            if kv.dtype != lay.torch_dtype:
                raise InvalidKV(f"kv must be {lay.dtype}")
            if n_blocks and not bool(torch.isfinite(kv).all()):
                raise InvalidKV("kv holds NaN or infinite values")
            if not n_blocks:
                return 0
            ns = rev.namespace(self.worker.deployment, req["tenant_salt"], origin="upload")
            hashes = chain_hashes(ns, tokens, rev.block_size, request_salt=request_salt(req.get("cache_salt")))
            return self.worker._tiers(
                "kv_store", rev, tenant=str(req["tenant"]), model=self.worker.deployment, revision=rev.label,
                ns_digest=ns.digest, hashes=hashes, tokens=tokens[: n_blocks * rev.block_size], kv=to_wire(kv),
                share_weight=req.get("share_weight"), max_cached_tokens=req.get("max_cached_tokens"))
