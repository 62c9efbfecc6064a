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
    # of the first admission (what the client is told): cached tokens per tier (l1, l2, l3) and why a
    # lower-tier load stopped short (``CachedSequence.load_stop``); and the prompt tokens the request
    # added to the cache over all its admissions
    cached_by_tier: dict[str, int] | None = None
    load_stop: str | None = None
    write_tokens: int = 0


Event = Prefilled | TokenOut | Finished
