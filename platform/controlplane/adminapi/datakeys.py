"""/api/admin/tenants/{slug}/data-keys: rotate, list (versions and states only), crypto-shred.

Mounted by ``adminapi.tenants``. Viewers may list; rotating and shredding need an admin (403).
Nothing here ever returns key material, clear or wrapped.
"""

from __future__ import annotations

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.schemas import DataKeyOut, DataKeyRotatedOut, DataKeyRotateIn
from controlplane.tenants import datakeys, selectors

router = Router(tags=["data keys"])


def data_key_out(key) -> dict:
    return {"version": key.version, "state": key.state, "created": key.created, "retired_at": key.retired_at,
            "shredded_at": key.shredded_at}


@router.post("tenants/{slug}/data-keys/rotate", response={201: DataKeyRotatedOut})
def rotate_data_key(request, slug: str, payload: DataKeyRotateIn | None = None):
    """A new active version (new L3 objects use it); the previous one is retired and stays readable.
    409 for an offboarded tenant."""
    key = datakeys.data_key_rotate(actor=actor_of(request), tenant=selectors.tenant_get(slug=slug),
                                   reason=payload.reason if payload else "")
    return Status(201, {"version": key.version})


@router.get("tenants/{slug}/data-keys", response=list[DataKeyOut])
def list_data_keys(request, slug: str):
    """Every version, oldest first, with its state (``active`` | ``retired`` | ``shredded``)."""
    return [data_key_out(k) for k in datakeys.data_key_list(tenant=selectors.tenant_get(slug=slug))]


@router.delete("tenants/{slug}/data-keys/{version}", response={202: dict})
def shred_data_key(request, slug: str, version: int, reason: str = ""):
    """Crypto-shred ``version`` everywhere: 202 with the ``shred`` job (``{"id", "status", ...}``,
    followed at ``flush-jobs/{id}``). The job deletes the wrapped key, makes every worker drop the key
    and delete that version's L3 objects, and verifies that they miss. Shredding the *active* version
    first rotates to a new active version (returned as ``rotated_to``), then shreds the old one.
    404 for an unknown version; shredding a version already shredded runs the job again (safe)."""
    from controlplane.jobs.selectors import flush_job_view

    tenant = selectors.tenant_get(slug=slug)
    was_active = datakeys.data_key_get(tenant=tenant, version=version).state == "active"  # 404 if unknown
    job = datakeys.data_key_shred(actor=actor_of(request), tenant=tenant, version=version, reason=reason)
    active = datakeys.data_key_list(tenant=tenant).filter(state="active").first() if was_active else None
    return Status(202, {**flush_job_view(job), "rotated_to": active.version if active else None})
