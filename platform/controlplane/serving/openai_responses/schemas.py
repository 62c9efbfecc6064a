"""The body of ``POST /v1/responses``, validated with pydantic: unknown fields refused, the OpenAI
fields that an official client may send but this server does not implement accepted only with the
value that is meaningful here (``tools: []``, ``truncation: "disabled"``, text format ``text``...).

``input``: a string (one user message) or a list of message items ``{"type"?: "message", "role",
"content"}`` whose content is a string or a list of ``input_text`` / ``output_text`` parts; other item
types (images, files, tool calls) are refused with 400 ``unsupported_input``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from controlplane.serving.schemas import MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MIN_TEMPERATURE

DEFAULT_MAX_OUTPUT_TOKENS = 256
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in TEXT_PARTS:
            raise ValueError(f"content part type {v!r} is not supported here (only input_text and output_text)")
        return v


class InputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str, Field(max_length=10_000_000)] | list[ContentPart]
    id: Annotated[str, Field(max_length=128)] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: dict | None = None

    @field_validator("format")
    @classmethod
    def _plain(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only the text format is supported")
        return v


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    store: StrictBool = True
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Literal[1, 1.0] | None = None
    stream: StrictBool = False
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = None
    cache_diagnostics: StrictBool = False  # Strata's: why prompt tokens were not reused
    # Accepted with the one value that means what this server does.
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    text: TextConfig | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict | None) -> dict | None:
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 metadata pairs")
        return v

    def items(self) -> list[InputItem]:
        """``input`` as message items (a string is one user message)."""
        if isinstance(self.input, str):
            return [InputItem(role="user", content=[ContentPart(type="input_text", text=self.input)])]
        return list(self.input)
