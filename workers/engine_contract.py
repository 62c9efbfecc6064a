"""The contract every replica's engine keeps, whichever engine serves (docs/design.md section 3, "Engines").

Two classes implement it: ``workers.cache_worker.CacheWorker`` (Strata's reference engine: block
pool, scheduler, Llama runner, L1/L2/L3) and ``workers.vllm_worker.VllmWorker`` (vLLM's async engine
in the replica's process). The Ray actor (``workers.actor``) wraps either one and delegates these
methods by name, so the gateway, router, jobs, stats and console never ask which engine serves.

Everything crosses processes as plain data: requests are ``workers.protocol.WorkerRequest.to_dict()``
and events are the ``workers.protocol`` event dicts.

Guarantees every implementation keeps:

- **Scope.** KV is shared exactly as far as the request's server-chosen ``scope_salt`` reaches,
  narrowed by its ``cache_salt``; a request never reuses KV computed under another scope, another
  model revision, another tokenizer or chat template, or before a flush of its scope.
- **Admission.** A tenant runs at most ``max_concurrent_requests`` requests at once on a replica
  (``tenant_busy``, retryable) and holds at most ``max_inflight_tokens`` (``inflight_limit``,
  retryable); when the engine is full, tenants take turns weighted by ``share_weight``.
- **Streams.** ``stream`` yields ``prefilled`` once, then one ``token`` per generated token, then
  exactly one ``finished`` or ``error`` event, and nothing after it. A stream that is closed early,
  cancelled (``cancel``/``cancel_tenant``) or whose revision was retired stops at its next step and
  frees what it held. Bad requests are an ``error`` event or a ``ValueError``, never a crash.
- **Exactness.** With temperature 0, a completion's tokens are the same whether its prefix was
  cached or computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from workers.protocol import Event

ENGINES = ("strata", "vllm")


@runtime_checkable
class ServingEngine(Protocol):
    """What a replica's engine offers (see the module docstring for the guarantees)."""

    deployment: str
    replica_id: str

    # ---------------------------------------------------------------- serving
    def stream(self, req: dict) -> Iterator[Event]:
        """Serve one ``WorkerRequest`` (as a dict); yields its events (module docstring)."""

    def collect(self, req: dict) -> list[Event]:
        """Every event of ``stream(req)`` at once (one round trip for a non-streamed call)."""

    def cancel(self, request_id: str) -> bool:
        """Stop the request ``request_id`` at its next step (its client went away). Remembered for a
        while, so a cancel that overtakes its request works too. True if such a request runs now."""

    def cancel_tenant(self, tenant: str, *, reason: str = "") -> dict:
        """Stop every running or waiting request of ``tenant`` (suspended, offboarded, shredded);
        returns ``{"cancelled", "remaining"}`` once they stopped (``remaining`` 0) or after a wait."""

    # ---------------------------------------------------------------- jobs
    def flush(self, scope: dict) -> dict:
        """Make ``scope`` (``{"scope": "tenant", "tenant"}``, ``"revision"``, ``"model"``, ``"all"``, and
        the L3-only ``key_version``/``tenant_l3``/``l3_expire``) unreachable at once in every tier this
        engine has: ``{"blocks_freed", "tokens_dropped", "tiers": {tier: blocks}, "l3_bytes",
        "bytes", "seconds"}``. Idempotent."""

    def probe(self, scope: dict) -> dict:
        """Verification after ``flush``: ``{"remaining_blocks", "ok"}`` (``ok``: the scope misses)."""

    def stage_revision(self, revision: dict) -> dict:
        """Load a new revision beside the active one; nothing serves from it yet."""

    def switch_revision(self, label: str, *, drain_seconds: float = 10.0) -> dict:
        """Rollout: new requests run on the staged ``label`` at once; the old revision's running
        requests drain until the deadline, the rest end with a retryable ``revision_changed``; then
        the old revision's cache and weights are freed. ``{"switched", "from", "revision",
        "aborted", "blocks_freed"}``."""

    def drop_data_key(self, req: dict) -> dict:
        """Crypto-shred ``{"tenant", "version"}`` here: ``{"objects", "bytes"}`` deleted. Idempotent."""

    # ---------------------------------------------------------------- named caches (workers.named_caches)
    def prewarm(self, req: dict, pin_until: float | None) -> dict:
        """Serve ``req`` (a ``WorkerRequest`` dict, ``max_tokens`` 1) through the normal path, wait
        until its writes to L2 (and L3 when ``persist``) landed, soft-pin the prompt's full blocks
        until ``pin_until`` (unix time; None: no pin): ``{"tokens", "cached_tokens", "tiers": {"l1",
        "l2", "l3"} (tokens resident per tier), "pinned"}``, or ``{"error": {"code", "message",
        "retryable"}}`` when the run ended with an error. The blocks are keyed as a completion of the
        prompt keys them (scope, revision, ``cache_salt``), so a later completion hits them."""

    def cache_pin(self, req: dict, pin_until: float | None) -> dict:
        """(Re)pin the prompt's full blocks on this replica until ``pin_until`` (None: unpin):
        ``{"tiers": {"l1", "l2", "l3"}}``. Pins are soft: evicted after the tenant's unpinned blocks,
        never at another tenant's fair share, lapsing at ``pin_until``."""

    def cache_drop(self, req: dict) -> dict:
        """Delete the prompt's full blocks from every tier of this replica and the L3 objects covering
        them (bytes gone from the backend), and unpin: ``{"tiers": {"l1": blocks, "l2": blocks, "l3":
        objects}, "bytes"}``. Idempotent. (vLLM: its own device cache keeps its copy until it evicts it;
        ``l1`` is 0.)"""

    def cache_resident(self, req: dict) -> dict:
        """``{"tiers": {"l1", "l2", "l3"}}``: tokens of the prompt's full-block prefix each tier holds
        (vLLM: ``l1`` is the replica's estimate of its device cache)."""

    # ---------------------------------------------------------------- introspection
    def info(self) -> dict:
        """Static facts: deployment, engine, revision, weight digest, device, layout, vocab and context
        sizes, ``namespace_fields`` (for the router's hashes), the ``router`` figures."""

    def stats(self) -> dict:
        """Token-weighted usage per tenant and per-tier figures (``CacheMetrics.snapshot`` layout),
        ``resident_blocks`` per tier and tenant, ``router``, ``kv_events``, ``worker``."""

    def kv_events(self, since_seq: int) -> dict:
        """KV event batches from ``since_seq`` on (``CacheWorker.kv_events``)."""

    def kv_snapshot(self) -> dict:
        """Every tier's block hashes as of the last seq (``EventLog.snapshot``)."""

    def ping(self) -> bool:
        """True: the replica is up."""

    def check_integrity(self) -> bool:
        """Assert every tier's invariants (``AssertionError`` naming the first broken one); True."""

    def drain_writes(self) -> None:
        """Wait until the tier writes queued so far (L2 write-through, L3 chunks) have landed."""
