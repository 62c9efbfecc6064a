"""Tenant data keys for L3 encryption at rest: the public API (docs/design.md section 2, "Encryption
at rest (L3)"). The rows, their lifecycle and the workers' view live in ``tenants.keystore`` and are
re-exported here; this module adds what reaches into other apps:

- :func:`data_key_shred` -- requests a ``shred`` job (jobs app). Shredding the *active* version first
  rotates to a new one (new objects keep being encrypted), then shreds the old one; an offboarded
  tenant gets no new version.

The split keeps the import graph acyclic: the jobs app (``data_key_destroy``, step 1 of a shred) and
the caches and serving paths (``data_key_for_worker``) import ``keystore``, never this module, while
this module imports the jobs services.
"""

from __future__ import annotations

from django.db import transaction

from controlplane.common.actor import Actor
from controlplane.jobs.services import shred_job_request
from controlplane.tenants.keystore import (  # noqa: F401  (re-exported: the data-key API)
    DATA_KEY_BYTES,
    SYSTEM,
    data_key_destroy,
    data_key_ensure,
    data_key_for_worker,
    data_key_get,
    data_key_list,
    data_key_rotate,
    data_key_shred_prepare,
    forget_all,
    invalidate,
    scrub_database,
    unwrap_tenant_key,
    wrap_tenant_key,
)
from controlplane.tenants.models import Tenant


def data_key_shred(*, actor: Actor, tenant: Tenant, version: int, reason: str = ""):
    """Crypto-shred ``version`` of ``tenant``'s data key everywhere: requests a ``shred`` job (jobs
    app) and returns it. The job deletes the wrapped key (step 1), makes every worker drop the key and
    that version's L3 objects (step 2) and verifies that they miss (step 3).

    Shredding the active version first rotates to a new active version (audited
    ``data_key.rotate``) in the same transaction, so the tenant keeps persisting under a fresh key;
    for an offboarded tenant no new version is made. Shredding a version already shredded requests
    the job again (it drops and verifies again everywhere: safe to repeat). NotFound for an unknown
    version."""
    reason = (reason or "").strip() or f"crypto-shred data key v{version}"
    with transaction.atomic():
        locked = data_key_shred_prepare(actor=actor, tenant=tenant, version=version, reason=reason)
        # Named caches persisted under that key lose their L3 copy: they end with it (their L1/L2
        # blocks decay as ordinary cache).
        from controlplane.caches.services import caches_forget_tenant

        caches_forget_tenant(locked)
        # Stored responses sealed under that version could never be opened again: they go now.
        from controlplane.conversations.services import responses_forget_key

        responses_forget_key(locked, version)
        return shred_job_request(actor=actor, tenant=locked, version=version, reason=reason)
