"""The Responses API's objects as the official ``openai`` client parses them (``openai.types.responses``):
the response, its output message, its usage, the input items and the stream's events.

Usage: ``input_tokens``, ``input_tokens_details`` (``cached_tokens``, ``cache_write_tokens`` and
Strata's ``cached_tokens_by_tier``), ``output_tokens``, ``output_tokens_details.reasoning_tokens`` (0),
``total_tokens``. A response cut by ``max_output_tokens`` is ``"incomplete"`` with
``incomplete_details.reason = "max_output_tokens"``; its stream still ends with ``response.completed``
(as vLLM's does), whose response carries that status.
"""

from __future__ import annotations

import secrets

from controlplane.serving import responses as chat_shapes


def new_item_id(kind: str = "msg") -> str:
    return f"{kind}_{secrets.token_hex(24)}"


def usage(finished: dict) -> dict:
    u = chat_shapes.usage(finished)
    details = u["prompt_tokens_details"]
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details["cached_tokens"],
                                     "cache_write_tokens": details["cache_write_tokens"],
                                     "cached_tokens_by_tier": details["cached_tokens_by_tier"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_message(item_id: str, text: str, status: str) -> dict:
    content = [] if status == "in_progress" else [output_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def response(*, rid: str, created: int, model: str, body, status: str, output: list[dict], usage: dict | None = None,
             finish_reason: str | None = None) -> dict:
    """A response object; ``body`` the request (``schemas.ResponseCreate``)."""
    incomplete = status == "completed" and finish_reason == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "instructions": body.instructions, "output": output,
        "previous_response_id": body.previous_response_id, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature if body.temperature is not None else 1.0, "top_p": 1.0,
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "truncation": "disabled",
        "store": body.store, "background": False, "metadata": body.metadata or {},
        "text": {"format": {"type": "text"}}, "reasoning": None, "service_tier": "default",
        "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
        "user": body.user, "usage": usage,
    }


def input_item(item: dict) -> dict:
    """A stored input item (``{"id", "role", "content"}``) as ``ResponseInputMessageItem`` (user, system,
    developer) or ``ResponseOutputMessage`` (assistant)."""
    if item["role"] == "assistant":
        return output_message(item["id"], item["content"], "completed")
    return {"id": item["id"], "type": "message", "role": item["role"], "status": "completed",
            "content": [{"type": "input_text", "text": item["content"]}]}


def item_list(items: list[dict]) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else "",
            "last_id": items[-1]["id"] if items else "", "has_more": False}


class Events:
    """The stream's events, each with the next ``sequence_number``."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
