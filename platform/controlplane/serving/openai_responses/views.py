"""``/v1/responses``: thin async views over ``turns`` (the request's stages), the runtime gateway and
``shapes`` (OpenAI's Responses objects).

- ``POST /v1/responses``: a turn, whole or streamed (``stream``), stored unless ``store: false``;
- ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
  (``order`` asc|desc, default desc; ``limit`` 1-100, default 20; ``after`` an item id).

Admitted like a chat (``serving.gate`` for the POST; the same keys, limits, quotas, ledger and
diagnostics); errors in the serving API's shape. Another tenant's id is a 404 exactly like a missing one.
"""

from __future__ import annotations

import time
from functools import partial

from django.http import HttpRequest, JsonResponse

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import InvalidInput, NotFound
from controlplane.common.sources import request_source
from controlplane.conversations import selectors as stored
from controlplane.conversations import services as store
from controlplane.conversations.models import new_response_id
from controlplane.serving import context, db_threads, health, render_pool
from controlplane.serving.admission import Admission, admitted, gate_admission
from controlplane.serving.openai_responses import shapes, stream, turns
from controlplane.serving.views import _account, _api_view, _collect


@_api_view(("POST",))
async def create(request: HttpRequest):
    admission = gate_admission(request) or await db_threads.for_request(request, admitted, request)
    tenant = admission.tenant
    parsed = await render_pool.run(tenant.pk, turns.parse, request, admission)
    before = await db_threads.for_request(request, turns.previous, tenant, parsed.body)
    turn = await render_pool.run(tenant.pk, turns.render, parsed, before, tenant.max_prompt_tokens)
    prep = await db_threads.for_request(request, context.prepare_rendered, request, tenant, parsed.deployment,
                                        parsed.facts, turns.chat_body(parsed.body, turn), turn.tokens)
    note = health.note_of(getattr(request, "scope", {}))
    if note is not None:  # the serving metrics' model label, and whether first-byte time is a TTFT
        note.model, note.stream = prep.model, parsed.body.stream
    job = Pending(request, admission, parsed, turn, prep)
    if parsed.body.stream:
        return await stream.respond(request, prep, job)
    tokens, finished = await _collect(prep, None)
    return JsonResponse(await job.finish([t["id"] for t in tokens], "".join(t["text"] for t in tokens), finished))


class Pending:
    """One ``POST /v1/responses`` once prepared: its id, its shapes, and ``finish`` (accounted, stored)."""

    def __init__(self, request: HttpRequest, admission: Admission, parsed: turns.Parsed, turn, prep) -> None:
        self.request, self.admission, self.parsed, self.turn, self.prep = request, admission, parsed, turn, prep
        self.rid, self.created, self.item_id = new_response_id(), int(time.time()), shapes.new_item_id()

    def response(self, status: str, output: list[dict], **kwargs) -> dict:
        return shapes.response(rid=self.rid, created=self.created, model=self.prep.model, body=self.parsed.body,
                               status=status, output=output, **kwargs)

    async def finish(self, generated: list[int], text: str, finished: dict) -> dict:
        """The completed response: accounted (the diagnosis added when asked for), then stored."""
        diagnosis = await _account(self.request, self.prep, finished)
        out = self.response("completed", [shapes.output_message(self.item_id, text, "completed")],
                            usage=shapes.usage(finished), finish_reason=finished["finish_reason"])
        out["completed_at"] = int(time.time())
        if diagnosis is not None:
            out["cache_diagnostics"] = diagnosis
        if self.parsed.body.store:
            await db_threads.for_request(self.request, partial(
                turns.store_turn, self.admission.tenant, rid=self.rid, parsed=self.parsed, turn=self.turn,
                prompt=self.prep.tokens, generated=generated, out=out, text=text))
        return out


def _tenant(request: HttpRequest):
    return admitted(request).tenant


def _found(request: HttpRequest, response_id: str) -> dict:
    found = stored.response_get(_tenant(request), response_id)
    if found is None:
        raise NotFound(f"response with id '{response_id}' not found", code="response_not_found")
    return found


def _delete(request: HttpRequest, response_id: str) -> None:
    admission = admitted(request)
    if not store.response_delete(tenant=admission.tenant, public_id=response_id):
        raise NotFound(f"response with id '{response_id}' not found", code="response_not_found")
    actor = Actor.at(f"tenant:{admission.tenant.slug}:{admission.key_prefix}", "api_key", request_source(request))
    audit_record(actor=actor, action="response.delete", target=response_id, tenant=admission.tenant.slug,
                 reason="deleted by the tenant")


@_api_view(("GET", "DELETE"))
async def detail(request: HttpRequest, response_id: str):
    if request.method == "DELETE":
        await db_threads.for_request(request, _delete, request, response_id)
        return JsonResponse({"id": response_id, "object": "response.deleted", "deleted": True})
    return JsonResponse((await db_threads.for_request(request, _found, request, response_id))["response"])


MAX_ITEMS = 100


@_api_view(("GET",))
async def input_items(request: HttpRequest, response_id: str):
    order, after, limit = request.GET.get("order", "desc"), request.GET.get("after"), request.GET.get("limit", "20")
    if order not in ("asc", "desc"):
        raise InvalidInput("order must be 'asc' or 'desc'", code="invalid_value")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_ITEMS:
        raise InvalidInput(f"limit must be an integer from 1 to {MAX_ITEMS}", code="invalid_value")
    items = (await db_threads.for_request(request, _found, request, response_id))["input_items"]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise InvalidInput(f"after: no input item '{after}' in this response", code="invalid_value")
        items = items[at + 1:]
    page = [shapes.input_item(item) for item in items[:int(limit)]]
    return JsonResponse({**shapes.item_list(page), "has_more": len(items) > int(limit)})
