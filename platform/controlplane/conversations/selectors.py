"""Reads of stored responses, always within one tenant: another tenant's id, an expired response, a
deleted one and one whose data-key version was shredded all read as missing (None)."""

from __future__ import annotations

from django.utils import timezone

from controlplane.conversations.models import StoredResponse
from controlplane.conversations.sealing import open_sealed


def responses_live(tenant):
    """``tenant``'s stored responses that have not expired."""
    return StoredResponse.objects.filter(tenant=tenant, expires_at__gt=timezone.now())


def response_get(tenant, public_id: str) -> dict | None:
    """The payload of ``tenant``'s live stored response ``public_id`` (opened under its data key), or None."""
    row = responses_live(tenant).filter(public_id=public_id).values_list("sealed", flat=True).first()
    return None if row is None else open_sealed(tenant.pk, public_id, row)


def responses_count(tenant) -> int:
    """How many live responses ``tenant`` keeps (what ``STRATA_MAX_STORED_RESPONSES`` bounds)."""
    return responses_live(tenant).count()
