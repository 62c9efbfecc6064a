"""The body of ``POST /v1/messages`` as Anthropic's Messages API defines it (text content only).

Unknown fields are refused (400), like the OpenAI bodies' (``serving.schemas``): a request for tools,
images or extended thinking is told so rather than answered without them. ``cache_control`` marks a
breakpoint on the system or any content block, and at the top level on the last block of the last
message (Anthropic's automatic caching): at most ``MAX_BREAKPOINTS`` in a request, as Anthropic
allows. ``max_tokens`` 0 only fills the cache (Anthropic's pre-warming): nothing is generated for the
client. ``temperature`` and ``top_p`` are accepted as the Messages API has defined them (newer SDKs
send them through ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from controlplane.serving.schemas import MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MIN_TEMPERATURE
from workers.stops import normalize_stops

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300, "1h": 3600}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> int:
        return TTL_SECONDS[self.ttl]


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # the SDK may send null


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | Annotated[list[TextBlock], Field(min_length=1)]

    def blocks(self) -> list[TextBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesRequest(BaseModel):
    """A Messages API request. ``cache_salt`` and ``cache_diagnostics`` are Strata's (the SDK's
    ``extra_body``), as on the OpenAI endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_LIMIT)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_diagnostics: StrictBool = False

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and v != 1.0:
            raise ValueError("only top_p=1 is supported")
        return v

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        return list(normalize_stops(v)) or None

    @model_validator(mode="after")
    def _breakpoints(self) -> MessagesRequest:
        last = self.messages[-1]
        blocks = last.blocks()
        if self.cache_control is not None and blocks[-1].cache_control is None:
            last.content = [*blocks[:-1], blocks[-1].model_copy(update={"cache_control": self.cache_control})]
        marked = sum(1 for b in self.system_blocks() if b.cache_control is not None)
        marked += sum(1 for m in self.messages for b in m.blocks() if b.cache_control is not None)
        if marked > MAX_BREAKPOINTS:
            raise ValueError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                             f"Found {marked}.")
        return self

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        return [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) else self.system
