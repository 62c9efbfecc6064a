"""The bodies of the tenant's named-cache calls (``/v1/caches``), validated by ``serving.intake.validate``
(422 naming the first bad field)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from controlplane.caches.services import TTL_DEFAULT
from controlplane.serving.schemas import Message, TokenId


class CacheCreate(BaseModel):
    """``POST /v1/caches``: exactly one of ``prompt`` (a string or token ids) and ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    ttl_seconds: StrictInt = TTL_DEFAULT
    display_name: Annotated[str, Field(max_length=200)] = ""
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if isinstance(self.prompt, str) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class CachePatch(BaseModel):
    """``PATCH /v1/caches/{id}``."""

    model_config = ConfigDict(extra="forbid")

    ttl_seconds: StrictInt
