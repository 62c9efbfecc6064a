"""What a stream yields: one ``Prefilled``, one ``TokenOut`` per generated token, then ``Finished``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prefilled:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose prefill was skipped
    prefill_seconds: float  # from submission to the end of the prompt's prefill (queue wait included)


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "aborted"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


Event = Prefilled | TokenOut | Finished
