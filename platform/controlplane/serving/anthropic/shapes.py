"""Worker events shaped as Anthropic's Messages API answers them: the ``message`` object, its
``usage`` (Anthropic's counts from the worker's, with the breakpoints' fates) and the stream's events
(``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``; ``error`` after the answer began).

Usage as Anthropic counts it: ``cache_read_input_tokens`` are the prompt tokens served from cache,
``cache_creation_input_tokens`` the tokens up to the deepest pinned breakpoint that were not
(written to the cache and pinned on this call; ``cache_creation`` splits them by TTL), and
``input_tokens`` the rest: the three add up to the prompt. Strata's extras: ``cache_breakpoints`` (each
breakpoint's fate: ``pinned``, ``not_pinned`` past ``max_pinned_tokens``, ``too_short``),
``cache_write_tokens`` and ``cached_tokens_by_tier``.
"""

from __future__ import annotations

import json
import uuid

from controlplane.caches.breakpoints import Kept
from controlplane.serving import responses
from controlplane.serving.anthropic import errors

HEADER = "x-strata-cache-control"


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def stop_reason(finished: dict) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished worker event."""
    if finished.get("finish_reason") == "length":
        return "max_tokens", None
    matched = finished.get("stop_sequence")
    return ("stop_sequence", matched) if matched else ("end_turn", None)


def usage(finished: dict, kept: list[Kept], *, silent: bool = False) -> dict:
    """``silent``: a ``max_tokens`` 0 request (the cache filled, nothing generated for the client)."""
    u = finished["usage"]
    prompt = int(u["prompt_tokens"])
    read = min(int(u.get("cached_tokens", 0)), prompt)
    by_ttl, done = {"5m": 0, "1h": 0}, read
    for k in sorted((k for k in kept if k.status == "pinned"), key=lambda k: k.pinned_tokens):
        if k.pinned_tokens > done:
            by_ttl[k.ttl] += k.pinned_tokens - done
            done = k.pinned_tokens
    creation = sum(by_ttl.values())
    strata = responses.usage(finished)["prompt_tokens_details"]
    return {
        "input_tokens": prompt - read - creation,
        "output_tokens": 0 if silent else int(u["completion_tokens"]),
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
        "cache_creation": {"ephemeral_5m_input_tokens": by_ttl["5m"], "ephemeral_1h_input_tokens": by_ttl["1h"]},
        "cache_breakpoints": [k.as_dict() for k in kept],
        "cache_write_tokens": strata["cache_write_tokens"],
        "cached_tokens_by_tier": strata["cached_tokens_by_tier"],
    }


def header(kept: list[Kept]) -> str | None:
    """The ``x-strata-cache-control`` value: each fate's count, ``not_pinned`` first (None without
    breakpoints)."""
    if not kept:
        return None
    counts = {s: sum(1 for k in kept if k.status == s) for s in ("not_pinned", "pinned", "too_short")}
    return "; ".join(f"{s}={n}" for s, n in counts.items() if n)


def message(mid: str, model: str, text: str, finished: dict, kept: list[Kept], *, silent: bool = False) -> dict:
    reason, matched = stop_reason(finished) if not silent else ("max_tokens", None)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [] if silent else [{"type": "text", "text": text}], "stop_reason": reason,
            "stop_sequence": matched, "usage": usage(finished, kept, silent=silent)}


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def opening(mid: str, model: str, prompt_tokens: int) -> list[bytes]:
    """The events before the first text: the message (no content yet), its text block, a ping."""
    start = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}}
    return [event("message_start", {"type": "message_start", "message": start}),
            event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}),
            event("ping", {"type": "ping"})]


def text_delta(text: str) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": text}})


def closing(finished: dict, kept: list[Kept], diagnosis: dict | None, *, silent: bool = False) -> list[bytes]:
    """The events after the last text: the block's end, the stop reason with the final usage (the
    breakpoints' fates included), the message's end."""
    reason, matched = stop_reason(finished) if not silent else ("max_tokens", None)
    delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
             "usage": usage(finished, kept, silent=silent)}
    if diagnosis is not None:
        delta["cache_diagnostics"] = diagnosis
    return [event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", delta), event("message_stop", {"type": "message_stop"})]


def stream_error(ev: dict) -> bytes:
    """A worker's ``error`` event in a stream that already answered 200, as Anthropic's ``error`` event
    (the status the whole answer would have had names its type)."""
    code = ev.get("code") or "worker_failed"
    status = responses.WORKER_ERRORS.get(code, (503, 2))[0]
    return event("error", errors.error_body(status, ev.get("message") or "the worker failed", code))
