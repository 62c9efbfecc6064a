"""OpenAI-compatible serving endpoints: thin async views over ``context`` (who, what, limits),
the runtime gateway (the worker) and ``responses`` (the OpenAI shapes).

Streaming uses server-sent events; each token is flushed as soon as the worker yields it. An error
before the first byte is a normal JSON error response; after that it is an ``error`` event followed
by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator

from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.common.errors import ApplicationError, InvalidInput, WorkerError, error_response
from controlplane.runtime import gateway
from controlplane.serving import accountant, accounting, context, db_threads, health, responses
from controlplane.serving.early_call import EarlyCall
from controlplane.serving.schemas import ChatRequest, CompletionRequest, KVRequest
from workers.protocol import KVWire


def _api_view(methods: tuple[str, ...]):
    """Async view wrapper: CSRF-exempt (bearer auth), method check, ApplicationError -> JSON error."""

    def decorate(fn):
        @csrf_exempt
        async def view(request: HttpRequest, *args, **kwargs):
            if request.method not in methods:
                resp = error_response(405, f"method {request.method} not allowed")
                resp["Allow"] = ", ".join(methods)
                return resp
            try:
                return await fn(request, *args, **kwargs)
            except ApplicationError as exc:
                return exc.response()

        view.__name__ = fn.__name__
        return view

    return decorate


@_api_view(("GET",))
async def models(request: HttpRequest):
    deployments, adapters = await context.models_for(request)
    return JsonResponse({"object": "list", "data": [
        *({"id": d.name, "object": "model", "created": int(d.created.timestamp()), "owned_by": "strata"}
          for d in deployments),
        *({"id": a.name, "object": "model", "created": a.created, "owned_by": "strata", "parent": a.deployment,
           "root": a.deployment} for a in adapters),  # as vLLM lists its LoRA modules
    ]})


async def _collect(prep: context.Prepared, started: gateway.Started | None) -> tuple[list[dict], dict]:
    tokens, finished = [], None
    events = await gateway.acall(prep.spec, "collect", prep.worker_req, timeout=gateway.GENERATION_TIMEOUT_S,
                                 started=started)
    for ev in events:
        if ev["type"] == "token":
            tokens.append(ev)
        elif ev["type"] == "finished":
            finished = ev
        elif ev["type"] == "error":
            raise WorkerError.from_event(ev)
    if finished is None:
        raise WorkerError.from_event({"code": "worker_failed", "message": "the worker ended without a result"})
    return tokens, finished


def _sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _stream(request: HttpRequest, prep: context.Prepared, kind: str, with_logprobs: bool
                  ) -> StreamingHttpResponse:
    events = gateway.astream(prep.spec, prep.worker_req).__aiter__()
    # Pull the first event before answering so an unreachable worker is a 503, not a broken stream.
    first = await events.__anext__()
    if first["type"] == "error":
        await _close(events)  # its replica's in-flight count released now, not when it is collected
        raise WorkerError.from_event(first)
    cid, created = responses.new_id("cmpl" if kind == "text" else "chatcmpl"), int(time.time())

    ended = []

    async def body() -> AsyncIterator[bytes]:
        # When the client goes away Django stops iterating and closes the response: the closer below
        # cancels the request on its worker unless the stream had ended (finalizing this generator
        # would too, via gateway.astream, but only once nothing references it any more).
        sent_first = False
        chain = _chain(first, events)
        async for ev in chain:
            if ev["type"] in ("finished", "error"):
                ended.append(True)
            if ev["type"] == "token":
                out = responses.chunk(kind, cid, prep.model, created, token=ev, first=not sent_first,
                                      with_logprobs=with_logprobs)
                if prep.body.return_token_ids:
                    responses.add_token_ids(out, kind, [ev["id"]], None if sent_first else prep.tokens)
                yield _sse(out)
                sent_first = True
            elif ev["type"] == "finished":
                diagnosis = await _account(request, prep, ev)
                last = responses.chunk(kind, cid, prep.model, created, finish_reason=ev["finish_reason"],
                                       first=not sent_first)
                if prep.body.return_token_ids:
                    responses.add_token_ids(last, kind, [], None if sent_first else prep.tokens)
                if diagnosis is not None:
                    last["cache_diagnostics"] = diagnosis
                yield _sse(last)
                if prep.body.include_usage:
                    yield _sse({"id": cid, "object": "chat.completion.chunk" if kind == "chat" else
                                "text_completion", "created": created, "model": prep.model, "choices": [],
                                "usage": responses.usage(ev)})
            elif ev["type"] == "error":  # e.g. the replica died mid-stream: retryable, then [DONE]
                yield _sse(responses.stream_error(ev))
                break
        # The worker's stream is over: closed now, so its replica's in-flight count is released before
        # the client reads [DONE] (a stream left suspended after an error is closed only when collected).
        await _close(chain, events)
        yield _sse("[DONE]")

    return sse_response(body(), prep, lambda: ended)


def sse_response(body, prep: context.Prepared, ended) -> StreamingHttpResponse:
    """``body`` (an async iterator of SSE bytes) as an unbuffered event-stream response. When Django
    closes it before ``ended()`` (the client went away mid-stream), the request is cancelled on its
    worker, so it stops at its next step and releases its blocks."""
    resp = StreamingHttpResponse(body, content_type="text/event-stream")
    rid = prep.worker_req.get("request_id")

    def cancel_unless_ended() -> None:
        if not ended() and rid:
            gateway.cancel_request(prep.spec, rid)

    resp._resource_closers.append(cancel_unless_ended)  # Django calls these from response.close()
    resp["Cache-Control"] = "no-cache"
    resp["X-Accel-Buffering"] = "no"
    return resp


async def _close(*streams) -> None:
    """``aclose`` each async generator (the one iterating another first); never raises."""
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for ev in rest:
        yield ev


async def _serve(request: HttpRequest, kind: str):
    """One completion (``kind`` "text") or chat completion ("chat"), streamed or whole. A whole one's
    worker call starts on its preparation thread (``EarlyCall``)."""
    early = EarlyCall()
    try:
        prep = await context.prepare(request, CompletionRequest if kind == "text" else ChatRequest, early)
    except asyncio.CancelledError:  # the client went away while the job ran: its call is not wanted
        early.abandon()
        raise
    started = early.take()
    note = health.note_of(getattr(request, "scope", {}))
    if note is not None:  # the serving metrics' model label, and whether first-byte time is a TTFT
        note.model, note.stream = prep.model, bool(prep.body.stream)
        note.dispatched = time.perf_counter()  # prepared: its worker call starts now (or already has)
    # completions: logprobs is a count (0 = chosen token only); chat: a flag (+ top_logprobs)
    with_logprobs = prep.body.logprobs is not None and prep.body.logprobs is not False
    if prep.body.stream:
        return await _stream(request, prep, kind, with_logprobs)
    tokens, finished = await _collect(prep, started)
    shape = responses.completion if kind == "text" else responses.chat_completion
    out = shape(prep.model, tokens, finished, with_logprobs=with_logprobs)
    if prep.body.return_token_ids:
        responses.add_token_ids(out, kind, [t["id"] for t in tokens], prep.tokens)
    diagnosis = await _account(request, prep, finished)
    if diagnosis is not None:
        out["cache_diagnostics"] = diagnosis
    return JsonResponse(out)


def _account_in_order(prep: context.Prepared, finished: dict) -> dict | None:
    accountant.drain()  # the history holds every request answered before this one
    return accounting.account(prep, finished)


async def _account(request: HttpRequest, prep: context.Prepared, finished: dict) -> dict | None:
    """The request's ledger and history entry: off the response path (``accountant``), or, when the
    client asked for its diagnosis, here (the answer carries it), on a serving database thread."""
    if prep.accounting is not None and prep.accounting.diagnostics:
        return await db_threads.for_request(request, _account_in_order, prep, finished)
    accountant.submit(prep, finished)
    return None


@_api_view(("POST",))
async def completions(request: HttpRequest):
    return await _serve(request, "text")


@_api_view(("POST",))
async def chat_completions(request: HttpRequest):
    return await _serve(request, "chat")


# ---------------------------------------------------------------------- KV API for external engines
@_api_view(("GET",))
async def kv_layout(request: HttpRequest):
    spec = await context.layout_spec(request, request.GET.get("model", ""))
    return JsonResponse(await gateway.acall(spec, "kv_layout"))


@_api_view(("POST",))
async def kv_lookup(request: HttpRequest):
    spec, _, req = await context.prepare_kv(request, KVRequest)
    return JsonResponse(await gateway.acall(spec, "kv_lookup", req))


@_api_view(("POST",))
async def kv_store(request: HttpRequest):
    """Upload KV for full blocks. Untrusted: exact size for the layout, finite values only, keyed under
    the uploading tenant alone and never read by a completion (``CacheWorker.kv_store``). The bytes go
    to the replica as they came (``workers.protocol.KVWire``); only the replica makes a tensor of them."""
    spec, body, req = await context.prepare_kv(request, KVRequest)
    layout = await gateway.acall(spec, "kv_layout")
    n_blocks = len(body.tokens) // layout["block_size"]
    if n_blocks == 0 and not body.kv:
        return JsonResponse({"stored_blocks": 0})
    # Megabytes of base64: decoded off the event loop, so one tenant's uploads never stall others' requests.
    kv = await asyncio.to_thread(_decode_kv, body.kv or "", n_blocks, layout)
    if kv is None:
        return JsonResponse({"stored_blocks": 0})
    # Finite values are checked by the worker, inside the job its scheduler charges to this tenant.
    stored = await gateway.acall(spec, "kv_store_wire", req, kv)
    return JsonResponse({"stored_blocks": stored, "blocks": n_blocks})


def _decode_kv(b64: str, n_blocks: int, layout: dict) -> KVWire | None:
    """The uploaded ``kv`` as ``[n_blocks, *page_shape]`` of the layout's dtype (None for no blocks);
    422 unless it is base64 of exactly that many bytes."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError:
        raise InvalidInput("kv must be base64", code="invalid_kv") from None
    expected = n_blocks * layout["bytes_per_block"]
    if len(raw) != expected:
        raise InvalidInput(f"kv holds {len(raw)} bytes; {n_blocks} full blocks need {expected}", code="invalid_kv")
    if n_blocks == 0:
        return None
    return {"shape": [n_blocks, *layout["page_shape"]], "dtype": layout["dtype"], "data": raw}


@_api_view(("POST",))
async def kv_retrieve(request: HttpRequest):
    spec, _, req = await context.prepare_kv(request, KVRequest)
    got = await gateway.acall(spec, "kv_retrieve_wire", req)
    kv = got["kv"]
    return JsonResponse({"hit_tokens": got["hit_tokens"], "origin": got["origin"], "dtype": kv["dtype"],
                         "shape": kv["shape"], "kv": base64.b64encode(kv["data"]).decode()})
