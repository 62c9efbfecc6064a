"""The messages between the web tier and a replica, whichever engine serves it: one worker request
(``WorkerRequest``) and the events of its stream (``Prefilled``, ``Token``, ``Finished``, ``Error``).

The control plane builds a ``WorkerRequest`` (``controlplane.serving.context``) from what it
authenticated and resolved; it travels through Ray as plain data (``to_dict``: Ray pickles dicts of
builtins cheaply and the router reads a few of its fields) and every engine reads it back with
``WorkerRequest.from_dict``, which refuses unknown fields and ill-typed values (``ValueError``), so a
field cannot be misspelt on one side and silently missing on the other.

Events are ``TypedDict``s: the stream is consumed by the gateway, the router and the views as dicts
(one per token, on the hot path), and these types are their schema. Build them with the
constructors below so each engine emits exactly the same shape.

Security: ``scope_salt`` is the server-chosen secret salt of the tenant (or of the share group the
tenant was put in); ``cache_salt`` is the client's optional narrowing salt, never a replacement for
it. Nothing in a worker request comes from the client unchecked except ``cache_salt``, the prompt
and the sampling options.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "TIERS", "Error", "Event", "Finished", "KVRetrieved", "KVWire", "Prefilled", "Token", "Usage", "WorkerRequest",
    "error_event", "finished_event", "fold_completion", "prefilled_event", "token_event",
]


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    """One completion for a replica (the fields a ``CacheWorker`` and a ``VllmWorker`` both read).

    ``prompt`` is token ids (the control plane tokenizes and renders chat templates, so limits and
    quotas are checked before a worker is involved). ``logprobs``: None (none), 0 (the chosen token's)
    or k (and the k most likely). ``stop``: a string or up to 4 (``workers.stops``). ``max_*`` and
    ``share_weight``: the tenant's quotas, None for the defaults. ``persist``/``retention_seconds``/
    ``tenant_retention_seconds``/``data_key``: the L3 policy (``controlplane.serving.context``).
    ``expected_revision``: fail with ``revision_changed`` when another revision is active.
    ``request_id``: what ``cancel`` names. ``use_cache`` False: neither read nor write the cache.
    ``lora``: the LoRA adapter to serve the request with (``{"name", "id", "digest", "path", "scope"}``,
    ``adapters.selectors.AdapterRef.to_worker``; None: the base model). Its ``scope`` is part of every
    cache key of the request (the namespace's ``lora_id``); only a vLLM replica serves one.
    """

    tenant: str
    scope_salt: bytes
    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = None
    user: str | None = None
    max_cached_tokens: int | None = None
    max_l3_bytes: int | None = None
    max_inflight_tokens: int | None = None
    max_concurrent_requests: int | None = None
    share_weight: int | None = None
    persist: bool = True
    retention_seconds: int | None = None
    tenant_retention_seconds: int | None = None
    data_key: dict | None = field(default=None, repr=False)
    expected_revision: str | None = None
    request_id: str | None = None
    use_cache: bool = True
    lora: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError("tenant must be a non-empty string")
        if not isinstance(self.scope_salt, bytes | bytearray):
            raise ValueError("scope_salt must be the bytes the server chose")
        if not isinstance(self.prompt, list | tuple):  # its ids are checked by the engine (invalid_prompt)
            raise ValueError("prompt must be a list of token ids")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if self.lora is not None and not (isinstance(self.lora, dict) and isinstance(self.lora.get("scope"), str)
                                          and self.lora["scope"] and isinstance(self.lora.get("id"), int)
                                          and isinstance(self.lora.get("path"), str)):
            raise ValueError("lora must be an adapter's {name, id, digest, path, scope}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | WorkerRequest) -> WorkerRequest:
        """The request a dict describes (as ``to_dict`` made it); ``ValueError`` for an unknown field
        or a bad value. A ``WorkerRequest`` is returned as it is."""
        if isinstance(data, WorkerRequest):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"a worker request is a dict, got {type(data).__name__}")
        unknown = set(data) - _FIELDS - _ROUTER_ANNOTATIONS
        if unknown:
            raise ValueError(f"unknown worker request field(s): {', '.join(sorted(unknown))}")
        values = {k: v for k, v in data.items() if k in _FIELDS}
        if "temperature" in values:
            values["temperature"] = float(values["temperature"] or 0.0)
        if "prompt" in values and isinstance(values["prompt"], tuple):
            values["prompt"] = list(values["prompt"])
        if "scope_salt" in values and isinstance(values["scope_salt"], bytearray):
            values["scope_salt"] = bytes(values["scope_salt"])
        try:
            return cls(**values)
        except TypeError as exc:  # a required field missing
            raise ValueError(f"bad worker request: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the trip through Ray (``from_dict`` reads it back)."""
        return {f: getattr(self, f) for f in _FIELD_ORDER}

    def with_(self, **changes: Any) -> WorkerRequest:
        return dataclasses.replace(self, **changes)


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(WorkerRequest))
_FIELDS = frozenset(_FIELD_ORDER)
# Fields the router adds on its way (``runtime.router``): read there, ignored by the engines.
_ROUTER_ANNOTATIONS = frozenset({"_route_hashes", "session"})


class Usage(TypedDict):
    """``cached_tokens_by_tier``: where the cached tokens came from (``l1`` the replica's device
    cache, ``l2`` its host pool, ``l3`` the remote tier; they sum to ``cached_tokens``).
    ``cache_write_tokens``: prompt tokens this request added to the cache. ``load_stop``: why a
    lower-tier load stopped short (``"late"``, ``"failed"``, ``"corrupt"``, ``"unavailable"``,
    ``"expired"``, ``"recompute"``) or None; ``replica``: the replica that served it; ``block_size``:
    its engine's cache block (these three are read by the control plane's miss diagnostics and never
    shown to the client)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    cache_write_tokens: int
    load_stop: str | None
    replica: str
    block_size: int


class Prefilled(TypedDict):
    """The prompt is computed: ``cached_tokens`` of its ``prompt_tokens`` were reused, not computed."""

    type: Literal["prefilled"]
    prompt_tokens: int
    cached_tokens: int
    revision: str


class Token(TypedDict):
    """One generated token; ``text`` is what it adds to the decoded completion (``workers.stops``)."""

    type: Literal["token"]
    id: int
    text: str
    logprob: float | None
    top_logprobs: dict[str, float] | None


class Finished(TypedDict):
    """The last event of a stream that ended: ``finish_reason`` "stop" or "length"."""

    type: Literal["finished"]
    finish_reason: str
    revision: str
    usage: Usage


class Error(TypedDict):
    """The last event of a stream that failed; ``retryable`` tells the client to try again. A request
    that was stopped (cancelled, or stopped by the platform) may carry the ``usage`` of what it did
    before it stopped (the reference engine's: its committed KV stays cached, and a prewarm books it)."""

    type: Literal["error"]
    code: str
    message: str
    retryable: bool
    usage: NotRequired[Usage]


Event = Prefilled | Token | Finished | Error


class KVWire(TypedDict):
    """KV blocks as plain data, how the KV API's bytes cross between the web tier and a replica
    (``kv_store_wire``, ``kv_retrieve_wire``; ``workers.kv_wire`` converts on the replica): ``data``
    is the raw bytes, in the machine's (little-endian) order, of a C-contiguous array of ``shape``
    and ``dtype`` (torch's name: ``float32``, ``float16``, ``bfloat16``). The web tier never holds a
    tensor, so it never imports torch."""

    shape: list[int]
    dtype: str
    data: bytes


class KVRetrieved(TypedDict):
    """``kv_retrieve_wire``: the tokens of the longer contiguous hit, its origin (``model`` or
    ``upload``; None without a hit) and its blocks."""

    hit_tokens: int
    origin: str | None
    kv: KVWire


def prefilled_event(*, prompt_tokens: int, cached_tokens: int, revision: str) -> Prefilled:
    return {"type": "prefilled", "prompt_tokens": int(prompt_tokens), "cached_tokens": int(cached_tokens),
            "revision": revision}


def token_event(token_id: int, text: str = "", logprob: float | None = None,
                top_logprobs: dict[str, float] | None = None) -> Token:
    return {"type": "token", "id": int(token_id), "text": text, "logprob": logprob, "top_logprobs": top_logprobs}


TIERS = ("l1", "l2", "l3")


def finished_event(*, finish_reason: str, revision: str, prompt_tokens: int, completion_tokens: int,
                   cached_tokens: int, by_tier: dict[str, int] | None = None, write_tokens: int = 0,
                   load_stop: str | None = None, replica: str = "", block_size: int = 0) -> Finished:
    """The last event of a stream that ended. ``by_tier`` None: every cached token counts as ``l1``."""
    tiers = {t: int((by_tier or {}).get(t, 0)) for t in TIERS}
    if by_tier is None:
        tiers["l1"] = int(cached_tokens)
    return {"type": "finished", "finish_reason": finish_reason, "revision": revision,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens, "cached_tokens": cached_tokens,
                      "cached_tokens_by_tier": tiers, "cache_write_tokens": int(write_tokens),
                      "load_stop": load_stop, "replica": replica, "block_size": int(block_size)}}


def fold_completion(events) -> dict:
    """A whole stream folded into one dict (the non-streaming ``complete``): ``token_ids``, ``text``,
    ``logprobs``, ``top_logprobs`` and the last event's fields (``finished`` or ``error``)."""
    out: dict = {"token_ids": [], "text": "", "logprobs": [], "top_logprobs": []}
    for ev in events:
        if ev["type"] == "token":
            out["token_ids"].append(ev["id"])
            out["text"] += ev["text"]
            if ev["logprob"] is not None:
                out["logprobs"].append(ev["logprob"])
            if ev["top_logprobs"] is not None:
                out["top_logprobs"].append(ev["top_logprobs"])
        elif ev["type"] in ("finished", "error"):
            out.update(ev)
    return out


def error_event(code: str, message: str, *, retryable: bool) -> Error:
    return {"type": "error", "code": code, "message": message, "retryable": retryable}
