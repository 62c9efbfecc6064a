"""The quota registry: every tenant quota declared once (issue 22, "One quota registry").

A :class:`QuotaSpec` says what a quota is (name, value type, bounds, what a null stands for, unit,
labels and help text) and where it is enforced: ``web`` (the control plane refuses the request:
serving gate, serving context, named caches) or ``worker`` (sent in the worker request under
``worker_field``, in the messages named by ``worker_messages``, and enforced by the replica).
``QUOTAS`` is the ordered registry. Everything else that handles quotas reads it, generically:

- the ``Tenant`` columns (one nullable column per quota, ``controlplane.tenants.models``) and
  ``Tenant.quotas``; the Django admin's field list;
- validation and the audit's ``effective`` (:func:`clean`, :func:`audited`, used by
  ``tenants.services``);
- the admin API's ``QuotasIn`` / ``QuotasOut`` (``adminapi.schemas``, built with
  ``pydantic.create_model``: names, types, bounds, help text in the OpenAPI document);
- the console's quota fields (``ui.tenant_forms``) and its read-only quota lists (``ui.present``);
- the worker requests (:func:`worker_values`: ``serving.context`` for completions and KV calls,
  ``caches.workers`` for named caches).

Adding a quota: one ``QuotaSpec`` here, its column's migration (``manage.py makemigrations`` writes
it), and its enforcement (for a worker quota, the field of ``workers.protocol.WorkerRequest`` and the
worker code that reads it). Nothing else lists quotas.

A null quota is "unlimited" (``null_means``), or a default the worker applies (a number in
``default`` when it is one); a ``0`` always means zero, never the default (``zero_hint``: a zero is
refused with that reason, for quotas whose zero would let the tenant run nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from controlplane.common.errors import InvalidInput
from workers.admission import DEFAULT_TENANT_CONCURRENCY

WORKER_MESSAGES = ("completion", "kv", "cache")  # a completion, a KV API call, a named cache's pin/drop
COLUMN_MAX = {16: 2**15 - 1, 32: 2**31 - 1, 64: 2**63 - 1}  # PositiveSmall/Positive/PositiveBigIntegerField
UNLIMITED = "unlimited"
RUN_NOTHING = " (0 would let the tenant run nothing: suspend it instead)"


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One quota. ``name``: its key everywhere (column, admin API field, form field, audit).

    - ``value_type``: ``int`` or ``float``; ``bits``: an int column's width (16, 32 or 64).
    - ``minimum`` / ``maximum``: the accepted range; ``maximum`` None: no bound of the quota's own
      (an int is then bounded by its column, ``upper``). The admin API's schema states ``maximum``.
    - ``default``: the number a null stands for where it is one; ``null_means``: what a null stands
      for, in words (``"unlimited"``, or the default: audited beside the null as ``effective``).
    - ``zero_hint``: why a 0 is refused (``minimum`` > 0): said by the service, the admin API and the
      console alike.
    - ``label`` / ``hint``: the console form's label and help text; ``short``: the tenants list's
      column label; ``null_display``: what a read-only page shows for a null; ``help``: the admin API's
      description (OpenAPI); ``unit``: what the number counts.
    - ``enforced``: ``web`` or ``worker``; ``enforced_in``: the modules that enforce it (paths as in
      docs/architecture.md). ``worker_messages``: the worker messages that carry it (``WORKER_MESSAGES``),
      as ``worker_field`` (default: ``name``).
    """

    name: str
    label: str
    hint: str
    help: str
    unit: str
    enforced: Literal["web", "worker"]
    enforced_in: tuple[str, ...]
    short: str = ""
    value_type: type = int
    bits: Literal[16, 32, 64] = 64
    minimum: int | float = 0
    maximum: int | float | None = None
    default: int | float | None = None
    null_means: str = UNLIMITED
    null_display: str = "—"
    zero_hint: str = ""
    worker_messages: frozenset[str] = frozenset()
    worker_field: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"quota name {self.name!r} is not an identifier")
        if self.value_type not in (int, float):
            raise ValueError(f"quota {self.name}: value_type must be int or float")
        if self.bits not in COLUMN_MAX:
            raise ValueError(f"quota {self.name}: bits must be 16, 32 or 64")
        if self.minimum < 0 or (self.upper is not None and self.minimum > self.upper):
            raise ValueError(f"quota {self.name}: bounds [{self.minimum}, {self.upper}] are empty or negative")
        if self.value_type is int and self.maximum is not None and self.maximum > COLUMN_MAX[self.bits]:
            raise ValueError(f"quota {self.name}: maximum {self.maximum} does not fit its {self.bits}-bit column")
        if self.zero_hint and self.minimum <= 0:
            raise ValueError(f"quota {self.name}: a zero_hint is for a quota that refuses 0")
        if self.enforced not in ("web", "worker") or not self.enforced_in:
            raise ValueError(f"quota {self.name}: say where it is enforced (web or worker, and in which modules)")
        if (self.enforced == "worker") != bool(self.worker_messages):
            raise ValueError(f"quota {self.name}: a worker quota is sent in worker messages, a web quota in none")
        if not set(self.worker_messages) <= set(WORKER_MESSAGES):
            raise ValueError(f"quota {self.name}: unknown worker message(s) {sorted(self.worker_messages)}")

    @property
    def upper(self) -> int | float | None:
        """The largest accepted value: ``maximum``, else an int column's capacity (a float: None)."""
        if self.maximum is not None:
            return self.maximum
        return COLUMN_MAX[self.bits] if self.value_type is int else None

    @property
    def unlimited(self) -> bool:
        """Null means unlimited (a limit), rather than a default the workers apply."""
        return self.null_means == UNLIMITED

    @property
    def sent_as(self) -> str | None:
        """The worker request's field for this quota; None when it is not sent to workers."""
        return (self.worker_field or self.name) if self.worker_messages else None

    def refusal(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable for this quota (the message of the 422), None when it is."""
        if value is None:
            return None
        accepted = (int,) if self.value_type is int else (int, float)  # a float quota takes 3 as 3.0
        if (not isinstance(value, bool) and isinstance(value, accepted)
                and not (isinstance(value, float) and not math.isfinite(value))
                and self.minimum <= value and (self.upper is None or value <= self.upper)):
            return None
        what = "an integer" if self.value_type is int else "a number"
        span = f"in [{self.minimum}, {self.upper}]" if self.upper is not None else f">= {self.minimum}"
        hint = self.zero_hint if value == 0 else ""
        return f"quota {self.name} must be null ({self.null_means}) or {what} {span}{hint}"


QUOTAS: tuple[QuotaSpec, ...] = (
    QuotaSpec(
        name="requests_per_minute", label="Requests / minute", short="req/min", hint="blank = unlimited",
        help="requests the tenant may make per minute, completions and KV calls alike, counted before the "
             "body is read (429 past it; null = unlimited)",
        unit="requests per minute", bits=32, enforced="web",
        enforced_in=("controlplane/serving/ratelimit.py", "controlplane/serving/admission.py"),
    ),
    QuotaSpec(
        name="tokens_per_minute", label="Tokens / minute", short="tokens/min", hint="blank = unlimited",
        help="tokens the tenant may use per minute: a completion's prompt plus max_tokens, a KV call's token "
             "list (429 past it; null = unlimited)",
        unit="tokens per minute", enforced="web",
        enforced_in=("controlplane/serving/ratelimit.py", "controlplane/serving/context.py"),
    ),
    QuotaSpec(
        name="max_cached_tokens", label="Max cached tokens", short="cached tokens", hint="blank = unlimited",
        help="a hard cap on the tokens of KV the tenant may hold cached on each worker, uploads included "
             "(null = unlimited)",
        unit="tokens", enforced="worker", enforced_in=("workers/cache_worker.py", "workers/kv_tiers.py"),
        worker_messages=frozenset({"completion", "kv", "cache"}),
    ),
    QuotaSpec(
        name="max_prompt_tokens", label="Max prompt tokens", short="prompt tokens", hint="blank = unlimited",
        help="the longest prompt of a completion, or token list of a KV call, the tenant may send (413 past "
             "it; null = unlimited: the model's context length)",
        unit="tokens", bits=32, enforced="web",
        enforced_in=("controlplane/serving/bounds.py", "controlplane/serving/context.py"),
    ),
    QuotaSpec(
        name="max_l3_bytes", label="Max L3 bytes", short="L3 bytes", hint="blank = unlimited",
        help="bytes of encrypted KV the tenant may keep in the remote store (L3); its oldest objects go first "
             "past it (null = unlimited)",
        unit="bytes", enforced="worker", enforced_in=("workers/cache_worker.py", "workers/kv_tiers.py"),
        worker_messages=frozenset({"completion", "kv", "cache"}),
    ),
    QuotaSpec(
        name="max_inflight_tokens", label="In-flight tokens", hint="per worker; blank = worker default",
        help="tokens (prompt plus max_tokens) the tenant's running requests may hold on each worker (429 past "
             "it; at least 1; null = half of each worker's device cache)",
        unit="tokens", minimum=1, null_means="the default, half of each worker's device cache",
        null_display="worker default", zero_hint=RUN_NOTHING, enforced="worker",
        enforced_in=("workers/cache_worker.py", "workers/vllm_worker.py"),
        worker_messages=frozenset({"completion"}),
    ),
    QuotaSpec(
        name="max_concurrent_requests", label="Concurrent requests",
        hint=f"per worker, completions and KV calls; blank = worker default ({DEFAULT_TENANT_CONCURRENCY})",
        help="requests, completions and KV calls together, the tenant may run at once on each worker (429 past "
             f"it; at least 1; null = {DEFAULT_TENANT_CONCURRENCY})",
        unit="requests", bits=32, minimum=1, default=DEFAULT_TENANT_CONCURRENCY,
        null_means=f"the default, {DEFAULT_TENANT_CONCURRENCY} per worker", null_display="worker default",
        zero_hint=RUN_NOTHING, enforced="worker", enforced_in=("workers/admission.py",),
        worker_messages=frozenset({"completion", "kv"}),
    ),
    QuotaSpec(
        name="share_weight", label="Share weight",
        hint="of each worker's cache and compute, 1-100; blank = 1 (equal shares)",
        help="weight of the tenant's fair share of each worker's cache and compute (1-100; null = 1)",
        unit="weight", bits=16, minimum=1, maximum=100, default=1, null_means="1, an equal share",
        null_display="1", enforced="worker", enforced_in=("workers/cache_worker.py", "workers/vllm_worker.py"),
        worker_messages=frozenset({"completion", "kv", "cache"}),
    ),
    QuotaSpec(
        name="max_pinned_tokens", label="Pinned tokens",
        hint="of named caches, soft-pinned in L2/L3; blank = 0 (none)",
        help="tokens of the tenant's named caches soft-pinned in L2 and L3 (null = 0: none pinned)",
        unit="tokens", default=0, null_means="0, no named cache is pinned", null_display="0", enforced="web",
        enforced_in=("controlplane/caches/services.py",),
    ),
    QuotaSpec(
        name="max_adapters", label="Private adapters", short="adapters", hint="LoRA adapters; blank = unlimited",
        help="LoRA adapters registered for the tenant alone (live ones; public adapters do not count) "
             "(409 quota_exceeded past it; null = unlimited)",
        unit="adapters", bits=32, enforced="web", enforced_in=("controlplane/adapters/services.py",),
    ),
)


def _check(specs: Sequence[QuotaSpec]) -> None:
    seen = [s.name for s in specs]
    if len(seen) != len(set(seen)):
        raise ValueError(f"quota names repeat: {seen}")


_check(QUOTAS)


def names() -> tuple[str, ...]:
    """The quotas' names, in registry order."""
    return tuple(s.name for s in QUOTAS)


def get(name: str) -> QuotaSpec:
    return next(s for s in QUOTAS if s.name == name)


def of(tenant: Any) -> dict[str, int | float | None]:
    """A tenant's quotas by name (``Tenant.quotas``)."""
    return {s.name: getattr(tenant, s.name) for s in QUOTAS}


def clean(values: Mapping[str, Any]) -> dict[str, int | float | None]:
    """Validate a (partial) quota mapping: known names only; each ``None`` or a value in its range.
    ``InvalidInput`` (422) naming the quota and its range otherwise."""
    known = names()
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InvalidInput(f"unknown quota(s): {', '.join(unknown)}; known: {', '.join(known)}")
    specs = {s.name: s for s in QUOTAS}
    for name, value in values.items():
        refusal = specs[name].refusal(value)
        if refusal is not None:
            raise InvalidInput(refusal)
    return dict(values)


def audited(values: Mapping[str, Any]) -> dict:
    """``values`` for an audit event, with ``effective``: what each null that means a default (not
    "unlimited") stands for; no ``effective`` key when there is none."""
    specs = {s.name: s for s in QUOTAS}
    effective = {k: specs[k].null_means for k, v in values.items()
                 if v is None and k in specs and not specs[k].unlimited}
    return {**values, "effective": effective} if effective else dict(values)


def worker_values(tenant: Any, message: str) -> dict[str, int | float | None]:
    """The quotas a worker ``message`` (one of ``WORKER_MESSAGES``) carries, by worker field."""
    if message not in WORKER_MESSAGES:
        raise ValueError(f"unknown worker message {message!r}")
    return {s.sent_as: getattr(tenant, s.name) for s in QUOTAS if message in s.worker_messages}
