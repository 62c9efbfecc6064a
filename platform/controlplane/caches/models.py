"""A named cache: a tenant's prefix, prefilled once (a prewarm) and soft-pinned in L2 and L3 until it
expires. The row keeps what a completion needs to use it by ``cache_id`` (the prompt's token ids, or
the chat messages it was rendered from) and what the ledger bills (pinned tokens over time).

The token ids are the tenant's own data, like the prompts it sends: they are shown to nobody (the
admin API and console show counts, tiers and times), never audited, and kept only while the cache is
live: deleted with the row's bytes (``deleted_at`` set, ``token_ids`` and ``messages`` cleared), and
cleared from an expired row by the next sweep (``services.caches_sweep``). The row itself stays, with
its counts and times (what the ledger bills).
"""

from __future__ import annotations

import secrets

from django.db import models


def new_cache_id() -> str:
    return "cache_" + secrets.token_hex(12)


class NamedCache(models.Model):
    public_id = models.CharField(max_length=40, unique=True, default=new_cache_id, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="named_caches")
    deployment = models.ForeignKey("registry.ModelDeployment", on_delete=models.CASCADE,
                                   related_name="named_caches")
    revision = models.CharField(max_length=100)  # the active revision's label when it was prewarmed
    adapter = models.ForeignKey("adapters.Adapter", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="+")  # the LoRA adapter it was prewarmed on (None: the base model)
    display_name = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=8, default="prompt")  # "prompt" (token ids) or "messages" (chat)
    token_ids = models.JSONField(default=list)  # the rendered prefix, as the worker saw it
    messages = models.JSONField(null=True, blank=True)  # chat: the messages it was rendered from
    cache_salt = models.CharField(max_length=512, null=True, blank=True)
    tokens = models.PositiveIntegerField()
    block_size = models.PositiveSmallIntegerField(default=16)  # the serving engine's cache block
    pinned_tokens = models.PositiveIntegerField(default=0)  # full-block tokens pinned (0: not pinned)
    tiers = models.JSONField(default=dict)  # tokens per tier, as the replicas last said (``residency``)
    tiers_at = models.DateTimeField(null=True, blank=True)  # when ``tiers`` were last true
    key_prefix = models.CharField(max_length=16, blank=True)  # the API key that created it
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)
    expires_at = models.DateTimeField()
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["tenant", "deleted_at"], name="caches_tenant_live")]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.tenant_id}, {self.tokens} tokens)"
