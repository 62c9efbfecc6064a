"""Request and response shapes of the admin API (docs/design.md section 5).

Input schemas are strict (a string is not an integer, ``true`` is not ``1``) and forbid unknown
fields, so typos answer 422 instead of being ignored. Outputs never carry salts, key hashes or keys
(except the one-time ``key`` of ``KeyCreatedOut``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

from ninja import Schema
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from controlplane.registry.engines import MAX_TENSOR_PARALLEL
from controlplane.registry.models import LABEL_PATTERN, NAME_PATTERN
from controlplane.registry.services import MAX_REPLICAS
from controlplane.tenants import quotas
from controlplane.tenants.models import RETENTION_MAX_SECONDS, SLUG_PATTERN
from controlplane.tenants.quotas import QuotaSpec


class StrictIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)


def _documented(spec: QuotaSpec) -> dict[str, Any]:
    return {"description": spec.help, "json_schema_extra": {"x-unit": spec.unit}}


def quota_in_field(spec: QuotaSpec) -> tuple[Any, Any]:
    """One quota of ``QuotasIn``: optional, nullable, its type, help text and unit from the registry.
    The schema states the quota's own bounds (``minimum``, ``maximum``); a refused 0 (``zero_hint``)
    and an int column's capacity are left to the service, whose 422 says why."""
    bounds = {"ge": 0 if spec.zero_hint else spec.minimum}
    if spec.maximum is not None:
        bounds["le"] = spec.maximum
    return (spec.value_type | None, Field(default=None, **bounds, **_documented(spec)))


def quota_schemas(specs: Sequence[QuotaSpec]) -> tuple[type[StrictIn], type[Schema]]:
    """``(QuotasIn, QuotasOut)`` for ``specs``: one field per quota, in registry order (every quota is
    in every tenant answer, null included)."""
    quotas_in = create_model("QuotasIn", __base__=StrictIn, __module__=__name__,
                             **{s.name: quota_in_field(s) for s in specs})
    quotas_out = create_model("QuotasOut", __base__=Schema, __module__=__name__,
                              **{s.name: (s.value_type | None, Field(**_documented(s))) for s in specs})
    return quotas_in, quotas_out


QuotasIn, QuotasOut = quota_schemas(quotas.QUOTAS)


class CachePolicyIn(StrictIn):
    persist: bool | None = Field(default=None, description="may this tenant's KV be written to L3 at all")
    retention_seconds: int | None = Field(default=None, ge=0, le=RETENTION_MAX_SECONDS,
                                          description="how long persisted KV may be served (default 86400)")


class CachePolicyOut(Schema):
    persist: bool
    retention_seconds: int


class TenantCreateIn(StrictIn):
    slug: str = Field(pattern=SLUG_PATTERN, max_length=63)
    name: str = Field(min_length=1, max_length=200)
    quotas: QuotasIn | None = None


class TenantPatchIn(StrictIn):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    status: Literal["active", "suspended"] | None = None
    quotas: QuotasIn | None = None
    cache_policy: CachePolicyIn | None = None
    reason: str = Field(default="", max_length=1000)


class TenantOut(Schema):
    slug: str
    name: str
    status: str
    quotas: QuotasOut
    cache_policy: CachePolicyOut
    share_group: str | None
    scope_fingerprint: str
    created: datetime
    updated: datetime


class JobRef(Schema):
    id: int | str
    status: str


class OffboardOut(Schema):
    tenant: TenantOut
    keys_revoked: int
    flush_job: JobRef | None


class DataKeyRotateIn(StrictIn):
    reason: str = Field(default="", max_length=1000)


class DataKeyRotatedOut(Schema):
    version: int


class DataKeyOut(Schema):
    """A data-key version and its state; never key material (not even wrapped)."""

    version: int
    state: Literal["active", "retired", "shredded"]
    created: datetime
    retired_at: datetime | None
    shredded_at: datetime | None


class KeyCreateIn(StrictIn):
    name: str = Field(default="", max_length=100)


class KeyOut(Schema):
    id: int
    prefix: str
    name: str
    created: datetime
    last_used: datetime | None
    revoked_at: datetime | None


class KeyCreatedOut(Schema):
    id: int
    key: str  # shown this once
    prefix: str
    name: str
    created: datetime


class GrantIn(StrictIn):
    model: str = Field(min_length=1, max_length=100)


class GrantOut(Schema):
    model: str
    created: datetime


class RevisionIn(StrictIn):
    label: str = Field(pattern=LABEL_PATTERN, max_length=64)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    weights_path: str | None = Field(default=None, min_length=1, max_length=1024)
    path: str | None = Field(default=None, min_length=1, max_length=1024)  # a Hugging Face checkpoint directory

    @model_validator(mode="after")
    def _one_source(self) -> RevisionIn:
        if sum(x is not None for x in (self.seed, self.weights_path, self.path)) != 1:
            raise ValueError("give exactly one of 'seed', 'weights_path' or 'path'")
        return self


class ModelCreateIn(StrictIn):
    name: str = Field(pattern=NAME_PATTERN, max_length=100)
    preset: str | None = Field(default=None, min_length=1, max_length=32)  # none for a checkpoint 'path'
    revision: RevisionIn
    architecture: str = Field(default="llama", max_length=32)
    tokenizer: str = Field(default="byte", min_length=1, max_length=64)
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    engine: Literal["strata", "vllm"] | None = Field(default=None, description=(
        "serving engine; omitted: vllm for a checkpoint vLLM can serve here, else strata (presets: strata)"))
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_TENSOR_PARALLEL, description=(
        "GPUs of one node per replica (vllm only; above 1 the Ray cluster must have such a node)"))

    @model_validator(mode="after")
    def _preset_or_path(self) -> ModelCreateIn:
        if (self.preset is None) == (self.revision.path is None):
            raise ValueError("give a 'preset' with a seed or weights_path revision, or a revision 'path' alone")
        return self


class ModelPatchIn(StrictIn):
    replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS, description=(
        "0 stops the deployment (tenants get 503 model_stopped); a positive count starts or scales it"))
    engine: Literal["strata", "vllm"] | None = Field(default=None, description=(
        "fixed at creation: only the current value is accepted (another is 409 engine_fixed)"))
    reason: str = Field(default="", max_length=500)

    @model_validator(mode="after")
    def _something(self) -> ModelPatchIn:
        if self.replicas is None and self.engine is None:
            raise ValueError("give 'replicas' (or 'engine', which cannot change)")
        return self


class DigestStateOut(Schema):
    state: str = Field(description="ready (digest known), hashing (done_bytes of total_bytes), failed (error): "
                                   "a revision serves only once ready")
    done_bytes: int | None = None
    total_bytes: int | None = None
    error: str | None = None
    message: str | None = Field(default=None, description='e.g. "hashing weights (N of M bytes, P%)"')


class RevisionOut(Schema):
    label: str
    source: str
    seed: int | None
    weights_path: str | None
    path: str | None
    digest: str = Field(description='the weights digest; "" while it is computed (see digest_state)')
    digest_state: DigestStateOut
    active: bool
    created: datetime


class ReplicaStateOut(Schema):
    replica: int
    name: str
    state: str
    elapsed_s: float | None = None
    phase: str | None = None
    error: str | None = None


class ModelOut(Schema):
    name: str
    preset: str
    architecture: str
    tokenizer: str
    replicas: int
    engine: str
    tensor_parallel_size: int
    active_revision: str | None
    revisions: list[RevisionOut]
    created: datetime
    status: str = Field(description="running, or stopped (replicas 0)")
    digest_state: DigestStateOut | None = Field(default=None, description=(
        "the active revision's digest_state: while it is not ready the model does not serve (503 "
        "model_starting) and no replica starts"))
    replica_states: list[ReplicaStateOut] | None = Field(default=None, description=(
        "each replica's state (GET models/{name} only): starting (elapsed_s, phase), ready, failed "
        "(error), stopping, stopped"))


class TierCapacityOut(Schema):
    label: str
    blocks: int
    tokens: int
    bytes: int
    sequences: int | None = Field(description="sequences of the model's full context the tier holds")


class ReplicaCapacityOut(Schema):
    """One replica's KV capacity, from its last stats sample (``runtime.capacity``)."""

    replica: int
    status: str | None = Field(description="the sample's poll: ok, starting, unreachable, not started, pending")
    stale: bool | None
    age_s: float | None
    sampled_at: str | None
    context_tokens: int | None = Field(description="the model's full context length")
    block_size: int | None = None
    bytes_per_block: int | None = None
    blocks_per_sequence: int | None = None
    tiers: dict[str, TierCapacityOut] = Field(default_factory=dict, description="l1, l2 and a sized l3")
    tokens: int | None = Field(None, description="L1 + L2 (the replica's own; L3 is shared)")
    sequences: int | None = Field(None, description="L1 + L2 sequences of the full context")


class ModelDetailOut(ModelOut):
    capacity: list[ReplicaCapacityOut] = Field(description="each replica's KV capacity (its last sample)")


class ShareGroupIn(StrictIn):
    slug: str = Field(pattern=SLUG_PATTERN, max_length=63)
    name: str = Field(min_length=1, max_length=200)


class MemberIn(StrictIn):
    tenant: str = Field(min_length=1, max_length=63)


class ShareGroupOut(Schema):
    slug: str
    name: str
    scope_fingerprint: str
    members: list[str]
    created: datetime


class AuditEventOut(Schema):
    seq: int
    time: datetime
    actor: str
    auth_method: str
    source: str
    peer: str = ""  # the TCP peer ``source`` was derived from (absent from older events)
    forwarded_for: str = ""  # X-Forwarded-For as received
    action: str
    target: str
    tenant: str
    old: object | None
    new: object | None
    reason: str
    result: str
    prev_hash: str
    hash: str


class AuditPageOut(Schema):
    items: list[AuditEventOut]
    next_before: int | None


class AuditVerifyOut(Schema):
    ok: bool
    length: int
    head: str
    first_bad: int | None


# ---------------------------------------------------------------------- stats (GET stats)
class _StatsOut(BaseModel):
    """Stats shapes pass on fields beyond those listed (workers add figures; none are removed). Plain
    pydantic models: ninja's ``Schema`` reads attributes and would drop the extra fields."""

    model_config = ConfigDict(extra="allow")


class LoadLatencyOut(_StatsOut):
    p50: float | None = Field(description="seconds; the worst worker's p50 in cluster figures")
    p99: float | None = Field(description="seconds; the worst worker's p99 in cluster figures")


class TierStatsOut(_StatsOut):
    hits: int
    hit_tokens: int
    bytes_in: int
    bytes_out: int
    failures: int
    corrupt_loads: int
    late_loads: int
    fallbacks_to_recompute: int
    promotions: int
    demotions: int
    capacity_blocks: int
    used_blocks: int
    capacity_bytes: int
    used_bytes: int
    evictions: int
    load_seconds: float
    load_latency: LoadLatencyOut


class UsageStatsOut(_StatsOut):
    """Token-weighted layers (each ``*_ratio`` is over ``query_tokens``); ``requests`` is secondary."""

    query_tokens: int
    lookup_hit_tokens: int
    load_success_tokens: int
    effective_hit_tokens: int
    stored_tokens: int
    lookup_hit_ratio: float
    load_success_ratio: float
    effective_hit_ratio: float
    saved_prefill_seconds: float
    prefill_seconds: float
    requests: int


class TenantStatsOut(UsageStatsOut):
    tenant: str = Field(description="the tenant's slug")
    hit_requests: int = Field(description="requests with some prefill skipped (secondary figure)")
    resident_bytes: dict[str, int] = Field(description="bytes of KV this tenant holds per tier")


class WorkerStatsOut(_StatsOut):
    model: str
    status: Literal["ok", "unreachable", "not started", "starting", "pending"] = Field(
        description="the last poll: answered, did not answer, no actor, constructor still running (not "
                    "asked), or no poll finished yet")
    sampled_at: str | None = Field(None, description="when the figures shown were taken (ISO 8601)")
    age_s: float | None = Field(None, description="seconds since then")
    stale: bool = Field(False, description="no figures yet, the last poll got no answer, or they are old")


class StatsOut(_StatsOut):
    totals: UsageStatsOut
    tiers: dict[str, TierStatsOut] = Field(description="per tier (l1, l2, l3): counters summed over workers")
    tenants: list[TenantStatsOut]
    workers: list[WorkerStatsOut]
    stale: bool = Field(False, description="some worker's figures are stale: the figures come from the last "
                                           "sample of each replica, never a call made for this request")
    stale_workers: int = 0


class AdapterReplaceIn(StrictIn):
    """New files for a registered adapter (same name, tenant and model): a new scope, served at once;
    the old one's KV leaves every tier through its ``adapter_delete`` job."""

    path: str = Field(min_length=1, max_length=1024)
    reason: str = Field(default="", max_length=2000)


class AdapterIn(StrictIn):
    """A LoRA adapter to register on a model: ``path`` is a PEFT adapter directory under
    ``STRATA_WEIGHTS_ROOT``; ``tenant`` (a slug) makes it that tenant's alone."""

    name: str = Field(pattern=NAME_PATTERN, max_length=100)
    path: str = Field(min_length=1, max_length=1024)
    tenant: str | None = Field(default=None, pattern=SLUG_PATTERN)


class AdapterOut(Schema):
    name: str
    model: str
    tenant: str | None
    digest: str
    rank: int
    alpha: float
    target_modules: list[str]
    dtype: str
    path: str
    state: str
    created: datetime
