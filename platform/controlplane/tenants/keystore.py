"""Tenant data keys for L3 encryption at rest (docs/design.md section 2, "Encryption at rest (L3)"):
the rows, their lifecycle and the workers' view. ``tenants.datakeys`` is the public API (it re-exports
everything here and adds ``data_key_shred``, which requests a job); this module imports no other app's
services, so the jobs app (``data_key_destroy``) and the serving path (``data_key_for_worker``) import
it without an import cycle back through the jobs and caches apps.

Envelope encryption: each tenant has data-key versions 1, 2, ...; each version's key is 32 random
bytes that exist in clear only for the instant it is wrapped here (``cachecore.crypto.wrap_key``,
AES-256-GCM under the master key, bound to the tenant id ``str(tenant.pk)`` and the version) and,
later, inside the cache workers that unwrap it with the same master key. The database holds only the
wrapped bytes; nothing else ever shows them (the admin API lists versions and states, audit events
carry versions only).

Writes (each audited in its transaction):

- :func:`data_key_ensure` -- version 1 (or the next version, after every earlier one was shredded)
  when the tenant has no active key; called lazily on the serving path (``data_key_for_worker``).
- :func:`data_key_rotate` -- a new active version; the previous one becomes ``retired`` (still
  readable, so older L3 objects still load).
- :func:`data_key_shred_prepare` -- the first half of ``datakeys.data_key_shred`` (which then
  requests the ``shred`` job): checks the version exists and, when it is the *active* one, rotates to
  a new one (new objects keep being encrypted); an offboarded tenant gets no new version.
- :func:`data_key_destroy` -- step 1 of a shred (or offboard) job: the wrapped key is deleted
  (``wrapped`` NULL, state ``shredded``); from that commit on no process can unwrap it.

Read for the workers: :func:`data_key_for_worker` (cached per tenant in this process for
``STRATA_DATA_KEY_CACHE_SECONDS``, dropped at once by a rotation or shred in this process).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Max
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, NotFound
from controlplane.common.masterkey import master_key
from controlplane.tenants.models import DataKey, Tenant

DATA_KEY_BYTES = 32
logger = logging.getLogger("controlplane.tenants")
SYSTEM = "data-keys"


def wrap_tenant_key(data_key: bytes, *, tenant: Tenant | int | str, version: int) -> bytes:
    """``data_key`` wrapped by the master key for (tenant id, version)."""
    from cachecore.crypto import wrap_key

    return wrap_key(master_key(), data_key, tenant=_tid(tenant), version=version)


def unwrap_tenant_key(wrapped: bytes, *, tenant: Tenant | int | str, version: int) -> bytes:
    """The inverse (tests and diagnostics; the control plane itself never needs a clear data key).
    Raises ``cachecore.crypto.DecryptError`` for bytes that do not unwrap under (tenant, version)."""
    from cachecore.crypto import unwrap_key

    return unwrap_key(master_key(), bytes(wrapped), tenant=_tid(tenant), version=version)


def _tid(tenant: Tenant | int | str) -> str:
    """The tenant id as workers see it (the worker request's ``"tenant"``): ``str(tenant.pk)``."""
    return str(tenant.pk if isinstance(tenant, Tenant) else tenant)


def _target(tenant: Tenant, version: int) -> str:
    return f"{tenant.slug}:v{version}"


def _locked(tenant: Tenant) -> Tenant:
    return Tenant.objects.select_for_update().get(pk=tenant.pk)


def _create_version(tenant: Tenant) -> DataKey:
    """The next version (never reusing a number), active, with a fresh random key wrapped at once.
    The caller holds the tenant row lock and has retired the previous active version."""
    latest = DataKey.objects.filter(tenant=tenant).aggregate(v=Max("version"))["v"] or 0
    version = latest + 1
    wrapped = wrap_tenant_key(secrets.token_bytes(DATA_KEY_BYTES), tenant=tenant, version=version)
    return DataKey.objects.create(tenant=tenant, version=version, wrapped=wrapped, state=DataKey.State.ACTIVE)


def _active(tenant: Tenant) -> DataKey | None:
    return DataKey.objects.defer("wrapped").filter(tenant=tenant, state=DataKey.State.ACTIVE).first()


def data_key_ensure(*, tenant: Tenant) -> DataKey:
    """The tenant's active data key, creating one (audited ``data_key.create``) if it has none.
    Conflict for an offboarded tenant (it never gets a key again)."""
    key = _active(tenant)
    if key is not None:
        return key
    try:
        with transaction.atomic():
            locked = _locked(tenant)
            if locked.status == Tenant.Status.OFFBOARDED:
                raise Conflict(f"tenant {locked.slug!r} is offboarded", code="tenant_offboarded")
            key = _active(locked)
            if key is not None:
                return key
            key = _create_version(locked)
            audit_record(actor=Actor.system(SYSTEM), action="data_key.create", target=_target(locked, key.version),
                         tenant=locked.slug, new={"version": key.version, "state": key.state})
            _invalidate_on_commit(locked.pk)
    except IntegrityError:  # another process created it first (databases without row locks)
        key = _active(tenant)
        if key is None:
            raise
    return key


def _rotate(locked: Tenant, *, actor: Actor, reason: str) -> DataKey:
    current = DataKey.objects.select_for_update().defer("wrapped").filter(
        tenant=locked, state=DataKey.State.ACTIVE).first()
    if current is not None:  # retired first: the database allows one active version per tenant
        current.state, current.retired_at = DataKey.State.RETIRED, timezone.now()
        current.save(update_fields=["state", "retired_at"])
    new = _create_version(locked)
    audit_record(actor=actor, action="data_key.rotate", target=_target(locked, new.version), tenant=locked.slug,
                 old={"version": current.version if current else None, "state": "active" if current else None},
                 new={"version": new.version, "state": new.state,
                      **({"retired": current.version} if current else {})}, reason=reason)
    _invalidate_on_commit(locked.pk)
    return new


def data_key_rotate(*, actor: Actor, tenant: Tenant, reason: str = "") -> DataKey:
    """A new active version for ``tenant``: new L3 objects use it; the previous active version is
    ``retired`` and stays readable. Audited ``data_key.rotate``. Conflict for an offboarded tenant."""
    with transaction.atomic():
        locked = _locked(tenant)
        if locked.status == Tenant.Status.OFFBOARDED:
            raise Conflict(f"tenant {locked.slug!r} is offboarded", code="tenant_offboarded")
        return _rotate(locked, actor=actor, reason=reason)


def data_key_shred_prepare(*, actor: Actor, tenant: Tenant, version: int, reason: str) -> Tenant:
    """Within the caller's transaction (``datakeys.data_key_shred``): lock ``tenant``'s row, check that
    ``version`` exists (NotFound otherwise) and, when it is the active version of a tenant not
    offboarded, rotate to a new active version first (audited ``data_key.rotate``), so the tenant
    keeps persisting under a fresh key. Returns the locked tenant."""
    locked = _locked(tenant)
    key = DataKey.objects.defer("wrapped").filter(tenant=locked, version=version).first()
    if key is None:
        raise NotFound(f"tenant {locked.slug!r} has no data key version {version}", code="data_key_not_found")
    if key.state == DataKey.State.ACTIVE and locked.status != Tenant.Status.OFFBOARDED:
        _rotate(locked, actor=actor, reason=f"rotated before shredding v{version}: {reason}")
    return locked


def data_key_destroy(*, actor: Actor, tenant: Tenant, versions: list[int] | None = None, reason: str = "",
                     job: int | None = None) -> list[int]:
    """Delete the wrapped keys of ``versions`` (every version when None) of ``tenant``: ``wrapped``
    NULL, state ``shredded``, one ``data_key.shred`` audit event each, all in one transaction (the
    caller's, when it has one). Returns the versions shredded now; those already shredded are
    skipped (idempotent)."""
    with transaction.atomic():
        keys = DataKey.objects.select_for_update().defer("wrapped").filter(tenant=tenant).exclude(
            state=DataKey.State.SHREDDED).order_by("version")
        if versions is not None:
            keys = keys.filter(version__in=list(versions))
        done = []
        now = timezone.now()
        for key in keys:
            old = key.state
            key.wrapped, key.state, key.shredded_at = None, DataKey.State.SHREDDED, now
            key.save(update_fields=["wrapped", "state", "shredded_at"])
            audit_record(actor=actor, action="data_key.shred", target=_target(tenant, key.version), tenant=tenant.slug,
                         old={"version": key.version, "state": old},
                         new={"version": key.version, "state": key.state, **({"job": job} if job else {})},
                         reason=reason)
            done.append(key.version)
        if done:
            _invalidate_on_commit(tenant.pk)
            transaction.on_commit(scrub_database)
    return done


def scrub_database() -> None:
    """After a shred commits: on SQLite (``secure_delete`` zeroes the freed bytes in the pages) move
    the WAL into the database file and truncate it, so no older page image with the wrapped key stays
    in the WAL. Best effort (a long reader can keep the WAL). PostgreSQL keeps the old row version
    until VACUUM reuses its space: see the README on shredding and backups."""
    if connection.vendor != "sqlite":
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except DatabaseError:
        logger.warning("could not checkpoint the SQLite WAL after a data-key shred", exc_info=True)


# ---------------------------------------------------------------------- the workers' view
_lock = threading.Lock()
_cache: dict[int, tuple[float, dict]] = {}  # tenant pk -> (expiry on the monotonic clock, value)
_generation: dict[int, int] = {}  # bumped by every invalidation: a fill that raced one is not kept
_CACHE_MAX = 10_000


def forget_all() -> None:
    """Forget every cached data-key set of this process (tests)."""
    with _lock:
        _cache.clear()


def invalidate(tenant_id: int) -> None:
    """Forget this process's cached data-key set of ``tenant_id``."""
    with _lock:
        _cache.pop(tenant_id, None)
        _generation[tenant_id] = _generation.get(tenant_id, 0) + 1


def _invalidate_on_commit(tenant_id: int) -> None:
    invalidate(tenant_id)  # now (readers of this transaction) and after the commit (readers racing it)
    transaction.on_commit(lambda: invalidate(tenant_id))


def _rows(tenant_id: int) -> list[tuple[int, str, bytes | None]]:
    return list(DataKey.objects.filter(tenant_id=tenant_id).order_by("version")
                .values_list("version", "state", "wrapped"))


def data_key_for_worker(tenant: Tenant) -> dict:
    """What a worker request carries so the worker can encrypt and decrypt ``tenant``'s L3 objects:

    ``{"version": int, "wrapped": bytes,                    # the active version: new objects use it
       "readable": [{"version": int, "wrapped": bytes}],    # every unshredded version, active included
       "shredded": [int]}``                                 # versions a worker must never hold

    The worker unwraps with the master key (``unwrap_key(master, wrapped, tenant=req["tenant"],
    version=v)``). Creates version 1 on first use. One query when not cached; the result is shared:
    treat it as read-only."""
    now = time.monotonic()
    ttl = float(getattr(settings, "STRATA_DATA_KEY_CACHE_SECONDS", 2.0))
    hit = _cache.get(tenant.pk) if ttl > 0 else None
    if hit is not None and hit[0] > now:
        return hit[1]
    with _lock:
        generation = _generation.get(tenant.pk, 0)
    rows = _rows(tenant.pk)
    if not any(state == DataKey.State.ACTIVE for _, state, _ in rows):
        data_key_ensure(tenant=tenant)
        with _lock:
            generation = _generation.get(tenant.pk, 0)
        rows = _rows(tenant.pk)
    live = [(v, state, bytes(w)) for v, state, w in rows if state != DataKey.State.SHREDDED and w is not None]
    version, wrapped = next(((v, w) for v, state, w in live if state == DataKey.State.ACTIVE), (None, None))
    if version is None:  # shredded between the two reads (offboarding): no key to hand out
        raise Conflict("this tenant has no usable data key", code="tenant_offboarded")
    value = {"version": version, "wrapped": wrapped, "readable": [{"version": v, "wrapped": w} for v, _, w in live],
             "shredded": [v for v, state, _ in rows if state == DataKey.State.SHREDDED]}
    if ttl > 0:
        with _lock:
            if _generation.get(tenant.pk, 0) == generation:
                if len(_cache) >= _CACHE_MAX:
                    _cache.clear()
                _cache[tenant.pk] = (now + ttl, value)
    return value


def data_key_list(*, tenant: Tenant):
    """Every version of ``tenant``'s data key, oldest first, without the wrapped bytes."""
    return DataKey.objects.filter(tenant=tenant).defer("wrapped").order_by("version")


def data_key_get(*, tenant: Tenant, version: int) -> DataKey:
    """Raises NotFound."""
    key = data_key_list(tenant=tenant).filter(version=version).first()
    if key is None:
        raise NotFound(f"tenant {tenant.slug!r} has no data key version {version}", code="data_key_not_found")
    return key
