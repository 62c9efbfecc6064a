"""Writes of stored responses: store (sealed under the tenant's data key, kept for its retention),
delete, forget on offboarding or a key shred, and the sweep of expired ones.

A tenant keeps at most ``settings.STRATA_MAX_STORED_RESPONSES`` live responses (default
``MAX_STORED_DEFAULT``): past it a new ``store: true`` request is 429 ``too_many_stored_responses``
before it is generated (``check_room``). A tenant whose ``retention_seconds`` is 0 keeps nothing:
its responses are answered and never stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import RateLimited
from controlplane.conversations import sealing, selectors
from controlplane.conversations.models import StoredResponse

logger = logging.getLogger("controlplane.conversations")

MAX_STORED_DEFAULT = 10_000
SWEEP_ACTOR = Actor.system("responses.sweep")


def max_stored() -> int:
    return int(getattr(settings, "STRATA_MAX_STORED_RESPONSES", MAX_STORED_DEFAULT))


def check_room(tenant) -> None:
    """429 when ``tenant`` already keeps as many live responses as it may."""
    limit = max_stored()
    if selectors.responses_count(tenant) >= limit:
        raise RateLimited(f"this tenant keeps {limit} stored responses, its limit; delete some "
                          "(DELETE /v1/responses/{id}) or send store: false", retry_after=60,
                          code="too_many_stored_responses")


def response_store(*, tenant, public_id: str, model: str, payload: dict, tokens: int) -> StoredResponse | None:
    """Keep ``payload`` as ``tenant``'s response ``public_id`` until its retention ends, sealed under its
    active data key; None (nothing kept) for a tenant whose retention is 0."""
    if tenant.retention_seconds <= 0:
        return None
    expires_at = timezone.now() + timedelta(seconds=tenant.retention_seconds)
    version, frame = sealing.seal(tenant, public_id, payload, int(expires_at.timestamp()))
    return StoredResponse.objects.create(public_id=public_id, tenant=tenant, model=model, key_version=version,
                                         sealed=frame, tokens=tokens, expires_at=expires_at)


def response_delete(*, tenant, public_id: str) -> bool:
    """Delete ``tenant``'s live response ``public_id``; False when it has none by that id."""
    deleted, _ = selectors.responses_live(tenant).filter(public_id=public_id).delete()
    return deleted > 0


def responses_forget_tenant(tenant) -> int:
    """Offboarding: every stored response of ``tenant`` is deleted. Returns how many."""
    return StoredResponse.objects.filter(tenant=tenant).delete()[0]


def responses_forget_key(tenant, version: int) -> int:
    """A shred of ``tenant``'s data-key ``version``: the responses sealed under it are deleted (they
    could never be opened again). Returns how many."""
    return StoredResponse.objects.filter(tenant=tenant, key_version=version).delete()[0]


@dataclass(frozen=True)
class SweepResult:
    responses: int = 0
    tenants: int = 0


def responses_sweep(*, now: datetime | None = None, actor: Actor = SWEEP_ACTOR) -> SweepResult:
    """Delete every stored response past its tenant's retention; one audit event (counts only) when
    any went. Idempotent."""
    now = now or timezone.now()
    with transaction.atomic():
        expired = StoredResponse.objects.filter(expires_at__lte=now)
        tenants = len(set(expired.values_list("tenant_id", flat=True)))
        count = expired.delete()[0]
        if not count:
            return SweepResult()
        audit_record(actor=actor, action="response.sweep", reason="stored responses past their retention",
                     new={"responses": count, "tenants": tenants})
    logger.info("stored-response sweep deleted %d responses", count)
    return SweepResult(responses=count, tenants=tenants)
