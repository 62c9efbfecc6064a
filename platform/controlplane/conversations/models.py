"""A stored response of the Responses API (``/v1/responses``): what a later turn that names it as
``previous_response_id`` continues, and what ``GET /v1/responses/{id}`` returns.

Everything the tenant sent or the model wrote (input items, instructions, output text, the prompt and
output token ids a follow-up turn is built from, usage) lives only in ``sealed``: one AES-256-GCM
frame under the tenant's data key version ``key_version`` (``conversations.sealing``: the L3
envelope, ``cachecore.crypto``). The clear columns say only whose it is, for which model, how big,
and until when it is kept (``expires_at``: its creation plus the tenant's ``retention_seconds``).
A row whose key version was shredded can never be opened again; offboarding, a shred of its version,
``DELETE /v1/responses/{id}`` and the sweep of expired rows delete it.
"""

from __future__ import annotations

import secrets

from django.db import models


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


class StoredResponse(models.Model):
    public_id = models.CharField(max_length=64, unique=True, default=new_response_id, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="stored_responses")
    model = models.CharField(max_length=200)  # the deployment's name when it was created
    key_version = models.PositiveIntegerField()  # the tenant's data-key version ``sealed`` is under
    sealed = models.BinaryField(editable=False)
    tokens = models.PositiveIntegerField(default=0)  # prompt + output tokens of the turn (sizes, not content)
    created = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["tenant", "expires_at"], name="responses_tenant_expiry"),
                   models.Index(fields=["expires_at"], name="responses_expiry")]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.tenant_id}, {self.tokens} tokens)"
