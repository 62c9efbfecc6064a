"""``POST /v1/responses`` with ``stream: true``: the Responses event stream over server-sent events
(``event: <type>`` and ``data: <json>``), each event with its ``sequence_number``:

``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token that adds text,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, then
(the turn accounted and stored) ``response.completed``. A worker error before the first event is a
normal JSON error response; after it, an ``error`` event and ``response.failed``. A client that goes
away cancels the request on its worker, as a chat stream does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from django.http import HttpRequest, StreamingHttpResponse

from controlplane.common.errors import WorkerError
from controlplane.runtime import gateway
from controlplane.serving import responses as chat_shapes
from controlplane.serving.openai_responses import shapes
from controlplane.serving.views import _chain, _close, sse_response

logger = logging.getLogger("controlplane.serving")


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _failed(ev: shapes.Events, job, code: str, message: str) -> list[bytes]:
    """An ``error`` event and ``response.failed``: the end of a stream that already answered 200."""
    failed = job.response("failed", [])
    failed["error"] = {"code": code, "message": message}
    return [_sse(ev("error", code=code, message=message, param=None)), _sse(ev("response.failed", response=failed))]


async def respond(request: HttpRequest, prep, job) -> StreamingHttpResponse:
    """The streamed answer of ``job`` (``views.Pending``) for ``prep``."""
    events = gateway.astream(prep.spec, prep.worker_req).__aiter__()
    # The first event before answering, so an unreachable worker is a 503, not a broken stream.
    first = await events.__anext__()
    if first["type"] == "error":
        await _close(events)
        raise WorkerError.from_event(first)
    ended: list[bool] = []

    async def body() -> AsyncIterator[bytes]:
        ev, item = shapes.Events(), job.item_id
        started = job.response("in_progress", [])
        yield _sse(ev("response.created", response=started))
        yield _sse(ev("response.in_progress", response=started))
        yield _sse(ev("response.output_item.added", output_index=0,
                      item=shapes.output_message(item, "", "in_progress")))
        yield _sse(ev("response.content_part.added", item_id=item, output_index=0, content_index=0,
                      part=shapes.output_text_part("")))
        text, ids = [], []
        chain = _chain(first, events)
        async for event in chain:
            if event["type"] in ("finished", "error"):
                ended.append(True)
            if event["type"] == "token":
                ids.append(event["id"])
                if event["text"]:
                    text.append(event["text"])
                    yield _sse(ev("response.output_text.delta", item_id=item, output_index=0, content_index=0,
                                  delta=event["text"], logprobs=[]))
            elif event["type"] == "finished":
                whole = "".join(text)
                yield _sse(ev("response.output_text.done", item_id=item, output_index=0, content_index=0,
                              text=whole, logprobs=[]))
                yield _sse(ev("response.content_part.done", item_id=item, output_index=0, content_index=0,
                              part=shapes.output_text_part(whole)))
                yield _sse(ev("response.output_item.done", output_index=0,
                              item=shapes.output_message(item, whole, "completed")))
                try:
                    out = await job.finish(ids, whole, event)
                except Exception:  # the answer was sent; storing it failed (the database): said so, no 500
                    logger.exception("a streamed response could not be stored")
                    for failure in _failed(ev, job, "store_failed", "the response could not be stored; retry"):
                        yield failure
                    break
                yield _sse(ev("response.completed", response=out))
            elif event["type"] == "error":  # e.g. the replica died mid-stream
                error = chat_shapes.stream_error(event)["error"]
                for failure in _failed(ev, job, error["code"], error["message"]):
                    yield failure
                break
        await _close(chain, events)

    return sse_response(body(), prep, lambda: ended)
