"""``POST /v1/messages``: Anthropic's Messages API over the chat completions path (``prepare``), whole
or streamed in Anthropic's events (``shapes``), its breakpoints kept as soft pins
(``caches.breakpoints``) once the worker has written the prompt's KV, before the answer ends (so the
next request finds them). Errors in Anthropic's shape (``errors``), before and during a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.caches import breakpoints
from controlplane.common.actor import Actor
from controlplane.common.errors import ApplicationError, WorkerError
from controlplane.common.sources import request_source
from controlplane.runtime import gateway
from controlplane.serving import context, db_threads, health, views
from controlplane.serving.admission import Admission
from controlplane.serving.anthropic import errors, prepare, shapes
from controlplane.serving.early_call import EarlyCall

logger = logging.getLogger("controlplane.serving")


def _pins(request: HttpRequest, admission: Admission, parsed: prepare.Parsed, prep: context.Prepared,
          finished: dict) -> tuple[list[breakpoints.Kept], list]:
    marks = [breakpoints.Mark(b.tokens, b.ttl, b.ttl_seconds) for b in parsed.rendered.breakpoints]
    actor = Actor.at(f"tenant:{admission.tenant.slug}:{admission.key_prefix}", "api_key", request_source(request))
    return breakpoints.breakpoints_pin(
        tenant=admission.tenant, deployment=parsed.deployment, revision=str(prep.accounting.revision),
        tokens=prep.tokens, marks=marks, cache_salt=prep.worker_req.get("cache_salt"),
        block_size=int(finished["usage"].get("block_size") or prep.accounting.block_size),
        key_prefix=admission.key_prefix, actor=actor)


async def _keep(request: HttpRequest, admission: Admission, parsed: prepare.Parsed, prep: context.Prepared,
                finished: dict) -> list[breakpoints.Kept]:
    """The request's breakpoints pinned (as far as ``max_pinned_tokens`` reaches) on every replica. A
    failure here never fails the answer: the request was served, its breakpoints say ``not_pinned``."""
    if not parsed.rendered.breakpoints:
        return []
    try:
        kept, targets = await db_threads.for_request(request, _pins, request, admission, parsed, prep, finished)
        if targets:
            await asyncio.to_thread(breakpoints.pin_on_replicas, targets)
        return kept
    except Exception:
        logger.exception("pinning the cache_control breakpoints failed")
        return [breakpoints.Kept(b.tokens, b.ttl, "not_pinned") for b in parsed.rendered.breakpoints]


def _view(fn):
    @csrf_exempt
    async def view(request: HttpRequest, *args, **kwargs):
        if request.method != "POST":
            resp = errors.error_response(405, f"method {request.method} not allowed")
            resp["Allow"] = "POST"
            return resp
        try:
            return await fn(request, *args, **kwargs)
        except ApplicationError as exc:
            return errors.from_exception(exc)

    view.__name__ = fn.__name__
    return view


@_view
async def messages(request: HttpRequest):
    early = EarlyCall()
    try:
        admission, parsed, prep = await prepare.prepare(request, early)
    except asyncio.CancelledError:  # the client went away while the job ran: its call is not wanted
        early.abandon()
        raise
    started = early.take()
    note = health.note_of(getattr(request, "scope", {}))
    if note is not None:
        note.model, note.stream = prep.model, parsed.body.stream
        note.dispatched = time.perf_counter()  # the tenant's queue time ends here (serving.health)
    if parsed.body.stream:
        return await _stream(request, admission, parsed, prep)
    tokens, finished = await views._collect(prep, started)
    kept = await _keep(request, admission, parsed, prep, finished)
    diagnosis = await views._account(request, prep, finished)
    out = shapes.message(shapes.message_id(), prep.model, "".join(t["text"] for t in tokens), finished, kept,
                         silent=parsed.body.max_tokens == 0)
    if diagnosis is not None:
        out["cache_diagnostics"] = diagnosis
    resp = JsonResponse(out)
    said = shapes.header(kept)
    if said:
        resp[shapes.HEADER] = said
    return resp


async def _stream(request: HttpRequest, admission: Admission, parsed: prepare.Parsed, prep: context.Prepared
                  ) -> StreamingHttpResponse:
    events = gateway.astream(prep.spec, prep.worker_req).__aiter__()
    first = await events.__anext__()  # an unreachable worker is an error answer, not a broken stream
    if first["type"] == "error":
        await views._close(events)
        raise WorkerError.from_event(first)
    mid, ended = shapes.message_id(), []

    async def body() -> AsyncIterator[bytes]:
        for chunk in shapes.opening(mid, prep.model, len(prep.tokens)):
            yield chunk
        chain = views._chain(first, events)
        async for ev in chain:
            if ev["type"] in ("finished", "error"):
                ended.append(True)
            if ev["type"] == "token" and ev["text"] and parsed.body.max_tokens:
                yield shapes.text_delta(ev["text"])
            elif ev["type"] == "finished":
                kept = await _keep(request, admission, parsed, prep, ev)
                diagnosis = await views._account(request, prep, ev)
                for chunk in shapes.closing(ev, kept, diagnosis, silent=parsed.body.max_tokens == 0):
                    yield chunk
            elif ev["type"] == "error":  # e.g. the replica died mid-stream
                yield shapes.stream_error(ev)
                break
        await views._close(chain, events)

    return views.sse_response(body(), prep, lambda: ended)
