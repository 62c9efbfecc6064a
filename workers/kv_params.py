"""What a vLLM request tells Strata's KV connector: ``TransferParams``, the schema of the request's
``kv_transfer_params`` (vLLM carries them from ``SamplingParams.extra_args`` to the connector in its
scheduler process).

Only the replica actor (``workers.vllm_worker``) builds them, from what the control plane
authenticated and resolved (``workers.protocol.WorkerRequest``): the tenant, its block keys (Strata's
chain hashes of the prompt under the tenant's namespace: scope salt, model revision, tokenizer and
template digests, KV layout, the client's narrowing ``cache_salt``), its wrapped data keys, quotas,
weight and L3 policy. A client never reaches them: the OpenAI API refuses a ``kv_transfer_params``
field (``serving``), ``WorkerRequest`` has no such field, and ``from_wire`` refuses anything that
is not exactly this shape (the connector then treats the request as uncached).

Plain data only (vLLM serializes them with msgpack between its processes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

KEY = "strata"  # kv_transfer_params = {KEY: TransferParams.to_wire()}
HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class TransferParams:
    """``hashes``: one 32-byte key per full block of the prompt (``cachecore.hashing.chain_hashes``).
    ``ns_digest``: the namespace digest (the blocks' ``Tag``). ``epoch``: the flush epoch the actor
    saw when it sent the request (a save from a request older than a flush of its scope is dropped).
    ``persist``/``retention_seconds``/``tenant_retention_seconds``/``data_key``: the L3 policy, as in
    ``WorkerRequest``."""

    tenant: str
    model: str
    revision: str
    ns_digest: bytes = field(repr=False)
    hashes: tuple[bytes, ...] = field(repr=False)
    epoch: int = 0
    share_weight: int | None = None
    max_cached_tokens: int | None = None
    max_l3_bytes: int | None = None
    persist: bool = True
    retention_seconds: int | None = None
    tenant_retention_seconds: int | None = None
    data_key: dict | None = field(default=None, repr=False)
    prefill_tokens_per_s: float | None = None  # the model's prefill rate the actor measured (load vs recompute)

    def to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["hashes"] = list(self.hashes)
        return {KEY: d}

    @classmethod
    def from_wire(cls, params: Any) -> TransferParams | None:
        """The params of one request, or None when they are absent or not exactly Strata's."""
        if not isinstance(params, dict) or set(params) != {KEY} or not isinstance(params[KEY], dict):
            return None
        d = dict(params[KEY])
        if set(d) - _FIELDS or not {"tenant", "model", "revision", "ns_digest", "hashes"} <= set(d):
            return None
        hashes = d.get("hashes")
        if not isinstance(hashes, list | tuple) or not all(isinstance(h, bytes) and len(h) == HASH_BYTES
                                                             for h in hashes):
            return None
        if not isinstance(d.get("tenant"), str) or not isinstance(d.get("ns_digest"), bytes):
            return None
        d["hashes"] = tuple(hashes)
        try:
            return cls(**d)
        except TypeError:
            return None


_FIELDS = frozenset(f.name for f in dataclasses.fields(TransferParams))
