"""Shape worker events into OpenAI response objects (whole and streamed chunks)."""

from __future__ import annotations

import time
import uuid

from controlplane.common import errors

# worker error code -> (HTTP status, retry-after seconds or None); one table, in common.errors
WORKER_ERRORS = errors.WORKER_ERRORS

# Returned logprobs are rounded to this many decimal places. The same prompt's logprobs differ in the
# last bits of a float32 when other requests share its batch (the batched matmuls sum in another
# order), so unrounded values would let a tenant tell that others are active. The differences are
# ~1e-6 in float32; rounding to 1e-4 hides them except where a value sits on a rounding boundary, and
# 1e-4 is still far finer than any use of a logprob (ranking, perplexity, calibration) needs.
LOGPROB_DECIMALS = 4


def round_logprob(value: float | None) -> float | None:
    """``value`` rounded to ``LOGPROB_DECIMALS`` places (None stays None; -0.0 becomes 0.0)."""
    return None if value is None else round(float(value), LOGPROB_DECIMALS) + 0.0


def _top(top: dict | None) -> dict:
    return {k: round_logprob(v) for k, v in (top or {}).items()}


def stream_error(event: dict) -> dict:
    """The SSE ``error`` object for a worker's ``error`` event in a stream that already answered 200:
    the API's error shape (status's ``type``, the worker's ``code``) with ``retryable`` and, when it is,
    ``retry_after`` (seconds; the ``Retry-After`` a response would carry: the header is long sent).
    Retryable means what it means for whole answers: a 429 or 503 in ``WORKER_ERRORS`` (an unknown code
    is the worker's failure: 503, retryable)."""
    code = event.get("code") or "worker_failed"
    status, retry_after = WORKER_ERRORS.get(code, (503, 2))
    body = errors.error_body(status, event.get("message") or "the worker failed", code=code)
    body["error"]["retryable"] = retry_after is not None
    if retry_after is not None:
        body["error"]["retry_after"] = retry_after
    return body


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(finished: dict) -> dict:
    """The OpenAI ``usage`` of a finished worker event: ``prompt_tokens_details`` carries
    ``cached_tokens``, ``cache_write_tokens`` (prompt tokens this request added to the cache) and
    ``cached_tokens_by_tier`` (where the cached ones came from: ``l1``, ``l2``, ``l3``)."""
    u = finished["usage"]
    by_tier = u.get("cached_tokens_by_tier") or {"l1": u["cached_tokens"], "l2": 0, "l3": 0}
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"],
                                  "cache_write_tokens": int(u.get("cache_write_tokens", 0)),
                                  "cached_tokens_by_tier": {t: int(by_tier.get(t, 0)) for t in ("l1", "l2", "l3")}},
    }


def completion_logprobs(tokens: list[dict]) -> dict:
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t["text"])
    return {
        "tokens": [t["text"] for t in tokens],
        "token_logprobs": [round_logprob(t["logprob"]) for t in tokens],
        "top_logprobs": [_top(t["top_logprobs"]) for t in tokens],
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[dict]) -> dict:
    return {"content": [
        {
            "token": t["text"],
            "logprob": round_logprob(t["logprob"]),
            "bytes": list(t["text"].encode()),
            "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())}
                             for k, v in _top(t["top_logprobs"]).items()],
        }
        for t in tokens
    ]}


def completion(model: str, tokens: list[dict], finished: dict, *, with_logprobs: bool) -> dict:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "text": "".join(t["text"] for t in tokens),
            "finish_reason": finished["finish_reason"],
            "logprobs": completion_logprobs(tokens) if with_logprobs else None,
        }],
        "usage": usage(finished),
    }


def chat_completion(model: str, tokens: list[dict], finished: dict, *, with_logprobs: bool) -> dict:
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "".join(t["text"] for t in tokens)},
            "finish_reason": finished["finish_reason"],
            "logprobs": chat_logprobs(tokens) if with_logprobs else None,
        }],
        "usage": usage(finished),
    }


def chunk(kind: str, cid: str, model: str, created: int, *, token: dict | None = None,
          finish_reason: str | None = None, first: bool = False, with_logprobs: bool = False) -> dict:
    """One streamed chunk; ``kind`` is ``"text"`` or ``"chat"``."""
    if kind == "text":
        choice = {"index": 0, "text": token["text"] if token else "", "finish_reason": finish_reason,
                  "logprobs": completion_logprobs([token]) if (token and with_logprobs) else None}
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    delta: dict = {}
    if first:
        delta["role"] = "assistant"
    if token is not None:
        delta["content"] = token["text"]
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
              "logprobs": chat_logprobs([token]) if (token and with_logprobs) else None}
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def add_token_ids(out: dict, kind: str, generated: list[int], prompt: list[int] | None = None) -> dict:
    """vLLM's ``return_token_ids`` on a response or a streamed chunk ``out`` (changed in place and
    returned): the choice's ``token_ids`` (the generated ids; a chunk: its own), and with ``prompt``
    (a stream: its first chunk only) ``prompt_token_ids``, on the choice of a completion and on the
    response of a chat, where vLLM puts them."""
    choice = out["choices"][0]
    choice["token_ids"] = list(generated)
    if prompt is not None:
        (choice if kind == "text" else out)["prompt_token_ids"] = list(prompt)
    return out
