"""Request bodies of the OpenAI-compatible serving API, validated with pydantic.

Unknown fields are refused (a typo such as ``max_token`` must not silently fall back to a default);
the OpenAI fields this server accepts but does not implement are listed with the only value that is
meaningful here, so official clients that send defaults keep working.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from workers.stops import normalize_stops

MAX_TOKENS_LIMIT = 4096
# Sampling divides float32 logits by the temperature: below ~1e-37 they overflow to inf and the
# probabilities become NaN. 0 means greedy; a positive temperature must be at least this (far from
# any overflow, and already indistinguishable from greedy in practice). OpenAI's range ends at 2.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
TokenId = Annotated[StrictInt, Field(ge=0)]


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    model: Annotated[str, Field(min_length=1, max_length=200)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # what torch's generator takes
    stream: StrictBool = False
    stream_options: dict | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # OpenAI's prompt_cache_retention: "in_memory" keeps this request's KV out of every tier beyond
    # host memory (recorded on its blocks; the remote tier honours it).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # Tenant cache controls: ``prompt_cache_key`` (OpenAI's) routes requests that share it to the
    # replica that served the last one (affinity inside the tenant's scope; never hashed into KV);
    # ``cache_id`` names a named cache whose prefix is prepended (``/v1/caches``);
    # ``cache_diagnostics`` asks why prompt tokens were not reused (``caches.diagnostics``).
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_id: Annotated[str, Field(pattern=r"^cache_[0-9a-f]{24}$")] | None = None
    cache_diagnostics: StrictBool = False
    n: Literal[1] = 1
    # OpenAI's stop: generation ends where the text contains one of these (not returned).
    stop: str | list[str] | None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    # vLLM's extension: the response carries the prompt's and the generated token ids (``responses``).
    return_token_ids: StrictBool | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        return list(normalize_stops(v)) or None

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if v != 1.0:
            raise ValueError("only top_p=1 is supported")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[TokenId]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]
    name: Annotated[str, Field(max_length=256)] | None = None


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None


class KVRequest(BaseModel):
    """Body of the KV API for external inference engines (lookup, store, retrieve)."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    tokens: Annotated[list[TokenId], Field(min_length=1)]
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    kv: str | None = None  # base64 of the raw little-endian bytes, store only
