"""Turn an HTTP request into a worker request: admit (``serving.admission``), validate, resolve scope,
apply quotas.

Everything that decides *whose* cache a request may touch happens here, on the server: the scope
salt comes from the authenticated tenant (or the share group it was put in), the namespace's model
revision from the registry. A client's ``cache_salt`` is passed on only as a narrowing salt.

L3 fields of every worker request (completions and KV API): ``persist`` (bool: may this request's KV
be written to L3, and may it be read from there), ``retention_seconds`` (int: how long it may be
served from there, and the expiry of the L3 objects it writes), ``tenant_retention_seconds`` (the
tenant's own retention, which the worker's sweep applies) and
``data_key`` (``tenants.datakeys.data_key_for_worker``: the tenant's active data-key version and
wrapped key, every readable version's wrapped key, and the shredded versions; the worker unwraps them
with the master key, bound to ``req["tenant"]``).

Tokenizer, chat template and limits come from ``model_facts.model_facts(deployment)`` (the preset's or
the checkpoint's own, loaded as the worker loads them).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.http import HttpRequest
from pydantic import BaseModel

from controlplane.caches.diagnostics import ChatParts
from controlplane.common.errors import InvalidInput, NotFound, TooLarge
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway
from controlplane.runtime.gateway import WorkerSpec
from controlplane.serving import bounds, db_threads, intake, ratelimit, render_pool
from controlplane.serving.admission import Admission, admitted, authenticate, gate_admission
from controlplane.serving.early_call import EarlyCall
from controlplane.serving.intake import BadRequest
from controlplane.serving.model_facts import ModelFacts, model_facts
from controlplane.tenants import quotas
from controlplane.tenants import selectors as tenant_selectors
from workers.protocol import WorkerRequest


@dataclass(frozen=True)
class Accounting:
    """What the ledger and the miss diagnostics need of a request (``serving.accounting``)."""

    tenant_id: int
    tenant_salt: bytes  # the tenant's own salt (its diagnostics history's key), never the share group's
    block_size: int
    revision: str
    persist: bool
    retention_seconds: int
    diagnostics: bool  # the client asked (body or header)
    parts: ChatParts | None = None  # chats: which message holds a token (rendered on demand)
    adapter: str | None = None  # the LoRA adapter the request named (its ``"model"``); None: the base model


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for its worker."""

    spec: WorkerSpec
    body: BaseModel
    model: str
    tokens: list[int]
    worker_req: dict  # workers.protocol.WorkerRequest.to_dict()
    accounting: Accounting | None = None
    adapter: str | None = None  # the LoRA adapter's name when the request named one (``model`` is then its name)


DIAGNOSTICS_HEADER = "HTTP_X_STRATA_CACHE_DIAGNOSTICS"


INLINE_BODY = 8 * 1024  # completion bodies up to this are parsed and tokenized in the request's own thread


def resolve_model(tenant, name: str) -> ModelDeployment:
    """The granted deployment, or the base deployment of an adapter the tenant may use
    (``adapters.selectors.usable``); 404 alike for unknown, not granted and another tenant's adapter
    (no enumeration)."""
    deployment = tenant_selectors.grant_get_deployment(tenant, name)
    if deployment is None:
        from controlplane.adapters.selectors import usable

        adapter = usable(tenant, name)
        deployment = tenant_selectors.grant_get_deployment(tenant, adapter.deployment) if adapter else None
    if deployment is None or deployment.active_revision is None:
        raise NotFound(f"model '{name}' does not exist or you do not have access to it", code="model_not_found")
    return deployment


RETENTION_24H = 86_400


def retention_for(tenant, prompt_cache_retention: str | None) -> int:
    """Seconds this request's persisted KV may be served: the tenant's retention, at most 24 h when
    the request says ``"24h"``."""
    if prompt_cache_retention == "24h":
        return min(tenant.retention_seconds, RETENTION_24H)
    return tenant.retention_seconds


def persist_allowed(tenant, prompt_cache_retention: str | None) -> bool:
    """May this request's KV go beyond host memory (L3)? Only if the tenant allows persistence with a
    retention above 0 and the request did not ask for ``"in_memory"``."""
    return bool(tenant.persist_kv and tenant.retention_seconds > 0 and prompt_cache_retention != "in_memory")


def _inline(request: HttpRequest, schema: type[BaseModel]) -> bool:
    """A completion (no chat template to render) whose declared body is at most ``INLINE_BODY``: its
    parsing and tokenizing cost microseconds, less than a hop into the render pool and back."""
    if "messages" in schema.model_fields:
        return False
    declared = request.META.get("CONTENT_LENGTH") or ""
    return declared.isdigit() and int(declared) <= INLINE_BODY


async def prepare(request: HttpRequest, schema: type[BaseModel], early: EarlyCall | None = None) -> Prepared:
    """A completion or chat request, admitted in the order that bounds what each step may cost: the
    tenant authenticated and its request counted (by ``serving.gate`` before the body was read, or
    here); the body (bounded by ``body_limit_for``) parsed, checked against the model's and tenant's
    bounds, validated and tokenized; the token quotas last.

    A small completion body is handled whole in one call on a serving database thread (``_prepare``;
    ``db_threads.for_request``: Django's thread of the request when it did not come through the gate),
    its admission included when the gate read the body first and deferred it (``admission.Deferred``).
    Chats and larger bodies are parsed, bounded, validated and rendered in the render pool (off the
    event loop, at most ``STRATA_RENDER_THREADS`` at once and the tenant's share of them), then finished
    on a database thread (quotas, data key).

    ``early``: the last job, on its thread, starts the worker call of a request that does not stream
    (``EarlyCall.start``)."""
    if _inline(request, schema):
        return await db_threads.for_request(request, _then_start, early, _prepare, request, schema)
    admission = gate_admission(request) or await db_threads.for_request(request, admitted, request)
    tenant = admission.tenant
    deployment, facts, body, tokens = await render_pool.run(tenant.pk, _parse, request, schema, admission)
    return await db_threads.for_request(request, _then_start, early, _finish, tenant, deployment, facts, body,
                                        tokens, _wants_diagnostics(request, body), admission.adapter(body.model))


def prepare_rendered(request: HttpRequest, tenant, deployment: ModelDeployment, facts: ModelFacts, body: BaseModel,
                     tokens: list[int]) -> Prepared:
    """A chat whose prompt ids the caller rendered (``serving.openai_responses``: a conversation that
    continues from its stored ids), finished as ``prepare`` finishes a chat: the same checks, quotas
    and worker request. Runs on a database thread (``db_threads.for_request``)."""
    return _finish(tenant, deployment, facts, body, tokens, _wants_diagnostics(request, body))


def _then_start(early: EarlyCall | None, fn, *args) -> Prepared:
    prep = fn(*args)
    if early is not None:
        early.start(prep)
    return prep


def _wants_diagnostics(request: HttpRequest, body: BaseModel) -> bool:
    header = request.META.get(DIAGNOSTICS_HEADER, "").strip().lower()
    return bool(getattr(body, "cache_diagnostics", False)) or header in ("1", "true", "yes")


def _parse(request: HttpRequest, schema: type[BaseModel], admission: Admission
           ) -> tuple[ModelDeployment, ModelFacts, BaseModel, list[int]]:
    """The body parsed within the admission's limit, its model resolved from the granted ones, bounded,
    validated and tokenized (``intake``): no database."""
    data = intake.decode_body(request, admission.body_limit)
    deployment, _adapter = admission.resolve(intake.model_name(data))  # an adapter is served on its base
    facts = model_facts(deployment)
    body, tokens = intake.render(data, schema, facts, admission.tenant.max_prompt_tokens)
    return deployment, facts, body, tokens


def _prepare(request: HttpRequest, schema: type[BaseModel]) -> Prepared:
    """``prepare`` whole in the calling thread: small completions, and benchmarks and tests that build
    a worker request directly."""
    admission = admitted(request)
    deployment, facts, body, tokens = _parse(request, schema, admission)
    return _finish(admission.tenant, deployment, facts, body, tokens, _wants_diagnostics(request, body),
                   admission.adapter(body.model))


def _with_named_cache(tenant, deployment: ModelDeployment, facts: ModelFacts, body: BaseModel,
                      tokens: list[int], adapter=None) -> list[int]:
    """The prompt with the named cache ``body.cache_id`` in front: its token ids before a completion's
    prompt, its messages before a chat's (rendered together, so the prefix is the cache's exactly as
    a template renders it). 404 for a cache that is not this tenant's live one."""
    from controlplane.caches.selectors import cache_get

    named = cache_get(tenant, body.cache_id)
    if named is None or named.deployment_id != deployment.pk or named.adapter_id != getattr(adapter, "id", None):
        raise NotFound(f"cache '{body.cache_id}' does not exist for model '{body.model}'",
                       code="cache_not_found")
    chat = hasattr(body, "messages")
    if chat != (named.kind == "messages"):
        raise BadRequest(f"cache '{body.cache_id}' was made from a {'chat' if not chat else 'prompt'}; "
                         f"use it with {'/v1/chat/completions' if not chat else '/v1/completions'}",
                         code="cache_kind_mismatch")
    if not chat:  # the prompt goes on after the cache's tokens: a text prompt without its own BOS
        rest = facts.tokenizer.encode(body.prompt, add_bos=False) if isinstance(body.prompt, str) else tokens
        return list(named.token_ids) + rest
    budget = intake.render_budget(bounds.prompt_bounds(facts, tenant.max_prompt_tokens))
    return intake.render_messages(facts, [*named.messages, *(m.model_dump() for m in body.messages)], budget)


def _parts(facts: ModelFacts, body: BaseModel, tokens: list[int], max_prompt_tokens: int | None
           ) -> ChatParts | None:
    """Which message of a chat holds a token of ``tokens`` (diagnostics only): prefixes of the chat are
    rendered later, a few and only when a divergence is to be named, within the request's own render
    budget."""
    if not hasattr(body, "messages"):
        return None
    messages = [m.model_dump() for m in body.messages]
    budget = intake.render_budget(bounds.prompt_bounds(facts, max_prompt_tokens))
    return ChatParts(tokens, [m["role"] for m in messages],
                     lambda k: facts.chat.render(messages[:k], add_generation_prompt=False, budget=budget))


def _finish(tenant, deployment: ModelDeployment, config: ModelFacts, body: BaseModel, tokens: list[int],
            diagnostics: bool = False, adapter=None) -> Prepared:
    """The exact checks once the prompt is tokenized (vocabulary, tenant limit, context, tokens per
    minute) and the worker request. ``adapter``: the ``adapters.selectors.AdapterRef`` the request
    named (its ``lora``: the adapter's scope is in every cache key of the request)."""
    if getattr(body, "cache_id", None):
        tokens = _with_named_cache(tenant, deployment, config, body, tokens, adapter)
    bad = next((t for t in tokens if t >= config.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})", code="invalid_prompt")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if tenant.max_prompt_tokens is not None and len(tokens) > tenant.max_prompt_tokens:
        raise TooLarge(f"prompt has {len(tokens)} tokens; this tenant's limit is {tenant.max_prompt_tokens}",
                       code="prompt_too_long")
    if len(tokens) + max_tokens > config.max_seq_len:
        raise BadRequest(f"prompt of {len(tokens)} tokens plus max_tokens={max_tokens} exceeds the model's "
                         f"context length of {config.max_seq_len}", code="context_length_exceeded")
    ratelimit.admit(tenant_id=tenant.pk, requests_per_minute=None,  # counted by admit
                    tokens_per_minute=tenant.tokens_per_minute, tokens=len(tokens) + max_tokens)
    logprobs = body.logprobs
    if hasattr(body, "messages"):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    spec = gateway.spec_for(deployment)
    worker_req = WorkerRequest(
        tenant=str(tenant.pk),
        scope_salt=tenant_selectors.tenant_scope_salt(tenant),
        cache_salt=body.cache_salt,
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=float(body.temperature or 0.0),
        seed=body.seed,
        logprobs=logprobs,
        stop=body.stop,
        user=body.user,  # the router's stickiness key (scoped to the tenant there); never hashed into KV
        **quotas.worker_values(tenant, "completion"),  # the quotas the worker enforces (the registry's)
        # L3 policy: the tenant's (may it persist at all, for how long), narrowed by the request's
        # prompt_cache_retention ("in_memory": never beyond host memory; "24h": at most a day).
        persist=persist_allowed(tenant, body.prompt_cache_retention),
        retention_seconds=retention_for(tenant, body.prompt_cache_retention),
        tenant_retention_seconds=tenant.retention_seconds,  # the worker's sweep applies the tenant's own
        data_key=tenant_selectors.data_key_for_worker(tenant),
        expected_revision=spec.revision["label"],
        request_id=uuid.uuid4().hex,  # the gateway cancels it on the worker if the client goes away
        lora=adapter.to_worker() if adapter is not None else None,
    ).to_dict()  # plain data through Ray; every engine reads it back with WorkerRequest.from_dict
    if body.prompt_cache_key:  # the router's stickiness key (scoped to the tenant there)
        worker_req["session"] = "pck:" + body.prompt_cache_key
    parts = None
    if diagnostics and not getattr(body, "cache_id", None):
        parts = _parts(config, body, tokens, tenant.max_prompt_tokens)
    accounting = Accounting(
        tenant_id=tenant.pk, tenant_salt=bytes(tenant.scope_salt), block_size=config.kv_layout.block_size,
        revision=spec.revision["label"], persist=worker_req["persist"],
        retention_seconds=int(worker_req["retention_seconds"] or 0), diagnostics=diagnostics, parts=parts,
        adapter=adapter.name if adapter is not None else None)
    return Prepared(spec=spec, body=body, model=adapter.name if adapter is not None else deployment.name,
                    tokens=tokens, worker_req=worker_req, accounting=accounting,
                    adapter=adapter.name if adapter is not None else None)


def _check_kv_tokens(tokens: list[int], deployment: ModelDeployment, tenant=None) -> None:
    """KV API token lists: bounded by the model's context length and the tenant's ``max_prompt_tokens``
    (413) and inside its vocabulary (422), checked before any worker is involved."""
    config = model_facts(deployment)
    limit = getattr(tenant, "max_prompt_tokens", None)
    if limit is not None and len(tokens) > limit:
        raise TooLarge(f"{len(tokens)} tokens; this tenant's limit is {limit}", code="prompt_too_long")
    if len(tokens) > config.max_seq_len:
        raise TooLarge(f"{len(tokens)} tokens exceed the model's context length of {config.max_seq_len}",
                       code="context_length_exceeded")
    bad = next((t for t in tokens if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})", code="invalid_prompt")


def _prepare_kv(request: HttpRequest, schema: type[BaseModel]) -> tuple[WorkerSpec, BaseModel, dict]:
    """A KV API request, under the same quotas as a completion: its token list counts as a prompt
    (``max_prompt_tokens``: 413) and against tokens-per-minute, every call against requests-per-minute,
    and the worker counts it against ``max_concurrent_requests`` while it runs (lookups and retrieves
    count their tokens too: each hashes them, and a retrieve copies KV out). ``tenant_salt`` is the
    tenant's own salt: uploads are keyed under it alone (never the share group's)."""
    admission = admitted(request)  # counted, and the body bounded, before it is parsed
    tenant, data = admission.tenant, intake.decode_body(request, admission.body_limit)
    deployment = admission.deployment(intake.model_name(data))  # base models only: an adapter's name is a 404
    facts = model_facts(deployment)
    bounds.check_token_list(data.get("tokens"), facts)  # before pydantic looks at every id
    body = intake.validate(data, schema)
    tokens = list(body.tokens)
    _check_kv_tokens(tokens, deployment, tenant)
    ratelimit.admit(tenant_id=tenant.pk, requests_per_minute=None,  # counted by admit
                    tokens_per_minute=tenant.tokens_per_minute, tokens=len(tokens))
    return gateway.spec_for(deployment), body, {
        "tenant": str(tenant.pk),
        "scope_salt": tenant_selectors.tenant_scope_salt(tenant),
        "tenant_salt": bytes(tenant.scope_salt),
        "cache_salt": body.cache_salt,
        "tokens": tokens,
        **quotas.worker_values(tenant, "kv"),  # the quotas the worker enforces (the registry's)
        "persist": persist_allowed(tenant, None),
        "retention_seconds": retention_for(tenant, None),
        "tenant_retention_seconds": tenant.retention_seconds,
        "data_key": tenant_selectors.data_key_for_worker(tenant),
    }


async def prepare_kv(request: HttpRequest, schema: type[BaseModel]) -> tuple[WorkerSpec, BaseModel, dict]:
    return await db_threads.for_request(request, _prepare_kv, request, schema)


def _layout_spec(request: HttpRequest, model: str) -> WorkerSpec:
    tenant = authenticate(request)
    if not model:
        raise BadRequest("query parameter 'model' is required", code="missing_model")
    return gateway.spec_for(resolve_model(tenant, model))


async def layout_spec(request: HttpRequest, model: str) -> WorkerSpec:
    return await db_threads.for_request(request, _layout_spec, request, model)


def _models_for(request: HttpRequest) -> tuple[list[ModelDeployment], list]:
    """The deployments granted to the request's tenant, and the adapters it may use
    (``adapters.selectors.AdapterRef``, by name)."""
    from controlplane.adapters.selectors import usable_for

    tenant = authenticate(request)
    grants = tenant_selectors.grant_list(tenant=tenant).select_related("deployment")
    adapters = sorted(usable_for(tenant).values(), key=lambda a: a.name)
    return [g.deployment for g in grants if g.deployment.active_revision_id is not None], adapters


async def models_for(request: HttpRequest) -> tuple[list[ModelDeployment], list]:
    return await db_threads.for_request(request, _models_for, request)
