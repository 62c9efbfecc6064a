"""Work a request can cost before it is admitted (issue 17, item 1): bounds before tokenizing, chat
templates within a budget, and the render pool's per-tenant share, mounted over HTTP.

"Before tokenizing" is proven by recording the calls the server makes to the tokenizer, the chat
template and the schema (``admission_helpers.calls``): none for a refused request, paired with a
request just within the bound that does reach them.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import pytest

from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.tokenizer import ChatTemplate
from tests.serving import admission_helpers
from tests.serving.admission_helpers import MODEL, err, post

# the fixtures, by name
calls, keys, server_url = admission_helpers.calls, admission_helpers.keys, admission_helpers.server_url


def _prompt_body_limit(max_prompt_tokens: int | None) -> int:
    from controlplane.registry.models import ModelDeployment
    from controlplane.serving.bounds import prompt_body_limit
    from controlplane.serving.model_facts import model_facts

    return prompt_body_limit(model_facts(ModelDeployment.objects.get(name=MODEL)), max_prompt_tokens)


def test_a_huge_string_prompt_is_refused_by_the_tenants_body_limit_before_parsing(server_url, keys, calls):
    limit = _prompt_body_limit(256)
    assert limit < 200_000  # what 256 tokens of the byte tokenizer can take, every character escaped
    message = err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": "x" * 3_000_000}),
                   413, "request_too_large")
    assert f"{limit} bytes" in message and calls == []
    # chunked, without a Content-Length to refuse it by, the view measures the body before parsing it
    body = json.dumps({"model": MODEL, "prompt": "x" * 300_000}).encode()
    resp = httpx.post(f"{server_url}/v1/completions", content=iter([body[:1000], body[1000:]]), timeout=60,
                      headers={"Authorization": f"Bearer {keys['acme']}", "Content-Type": "application/json"})
    assert f"{limit} bytes" in err(resp, 413, "request_too_large") and calls == []


def test_a_long_string_prompt_within_the_body_limit_is_refused_before_tokenizing(server_url, keys, calls):
    message = err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": "x" * 100_000}),
                   413, "prompt_too_long")
    assert "256 tokens" in message and calls == []
    # paired: a prompt within the bound is tokenized (and then refused by the exact count: BOS + 256)
    err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": "x" * 256}),
         413, "prompt_too_long")
    assert "encode" in calls


def test_a_string_prompt_longer_than_the_context_is_refused_before_tokenizing(server_url, keys, calls, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=keys["tenant"], quotas={"max_prompt_tokens": None})
    message = err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": "y" * 2000}),
                   400, "context_length_exceeded")
    assert "1024" in message and calls == []


def test_a_huge_token_list_is_refused_before_validating_it(server_url, keys, calls):
    ids = [7] * 1_500_000  # 3 MiB of JSON, under the path's limit of 4 MiB
    err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": ids}), 413, "request_too_large")
    err(post(server_url, keys["acme"], "/v1/kv/lookup", {"model": MODEL, "tokens": ids}), 413, "request_too_large")
    assert calls == []
    # within the body limits, the lengths are bounded before the schema looks at every id
    err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": [7] * 30_000}), 413,
         "prompt_too_long")
    err(post(server_url, keys["acme"], "/v1/kv/lookup", {"model": MODEL, "tokens": [7] * 1100}), 413,
         "context_length_exceeded")
    assert calls == []
    err(post(server_url, keys["acme"], "/v1/completions", {"model": MODEL, "prompt": [7] * 250, "max_tokens": 0}),
         422, "invalid_value")
    assert calls == ["validate"]  # paired: within the bound the schema does run


def test_a_million_message_chat_is_refused_by_the_body_limits_and_a_thousand_by_the_message_bound(
        server_url, keys, calls):
    million = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}] * 1_000_000}).encode()
    assert len(million) < 32 * 1024 * 1024  # under the old limit of every /v1/ body
    message = err(post(server_url, keys["acme"], "/v1/chat/completions", million), 413, "request_too_large")
    assert "4194304 bytes" in message  # the serving path's limit, from Content-Length
    ten_thousand = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 10_000}
    message = err(post(server_url, keys["acme"], "/v1/chat/completions", ten_thousand), 413, "request_too_large")
    assert f"{_prompt_body_limit(256)} bytes" in message  # the tenant's, from its models and quota
    thousand = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 1000}
    message = err(post(server_url, keys["acme"], "/v1/chat/completions", thousand), 413, "too_many_messages")
    assert "256" in message and calls == []
    long = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 200}] * 2}
    err(post(server_url, keys["acme"], "/v1/chat/completions", long), 413, "prompt_too_long")
    assert calls == []
    # paired: a chat within both bounds is rendered (and then refused by the exact token count)
    fits = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 120}] * 2}
    err(post(server_url, keys["acme"], "/v1/chat/completions", fits), 413, "prompt_too_long")
    assert "render" in calls


def test_a_kv_upload_over_what_the_tenants_models_can_need_is_413_before_parsing(server_url, keys, calls):
    from controlplane.registry.models import ModelDeployment
    from controlplane.serving.bounds import kv_store_body_limit
    from controlplane.serving.model_facts import model_facts

    limit = kv_store_body_limit(model_facts(ModelDeployment.objects.get(name=MODEL)))
    assert limit < 1024 * 1024  # a full 1,024-token context of the tiny model's float32 KV, in base64
    body = json.dumps({"model": MODEL, "tokens": [1] * 16, "kv": "A" * (limit + 10)}).encode()
    message = err(post(server_url, keys["acme"], "/v1/kv/store", body), 413, "request_too_large")
    assert f"{limit} bytes" in message and calls == []
    # paired: just under the limit the body is parsed and validated (and refused by the token bound)
    body = json.dumps({"model": MODEL, "tokens": [1] * 1100, "kv": "A" * (limit - 10_000)}).encode()
    err(post(server_url, keys["acme"], "/v1/kv/store", body), 413, "context_length_exceeded")


RUNAWAY = "{% for i in range(2000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{{ messages[0].content * 300 }}"
BLOWUP = "{% for m in messages %}{{ m.content * 5000 }}{% endfor %}"


@pytest.mark.parametrize(("source", "code"), [(RUNAWAY, "template_budget_exceeded"),
                                              (BLOWUP, "template_output_too_large")])
def test_a_runaway_or_exploding_chat_template_is_refused_naming_its_limit(server_url, keys, monkeypatch, settings,
                                                                           source, code):
    """A checkpoint template (the real ``JinjaChatTemplate``) that loops 2M times or renders 5,000 times
    its input: each stops at its own budget. Without the guard both would render and be refused only
    afterwards, by the token count (``prompt_too_long``)."""
    from controlplane.serving import context
    from controlplane.serving.model_facts import BYTE_TOKENIZER

    real = context.model_facts
    monkeypatch.setattr(context, "model_facts", lambda deployment: dataclasses.replace(
        real(deployment), chat=JinjaChatTemplate(BYTE_TOKENIZER, source, {})))
    settings.STRATA_RENDER_BUDGET_MS = 600_000  # the step count, not this machine's speed, stops the loop
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ab"}]}
    message = err(post(server_url, keys["acme"], "/v1/chat/completions", chat), 413, code)
    assert ("1000000 steps" if code == "template_budget_exceeded" else "256 characters") in message
    assert httpx.get(f"{server_url}/healthz", timeout=10).status_code == 200



def test_one_tenants_renders_cannot_take_every_render_thread(server_url, keys, actor, monkeypatch, settings):
    """Two render threads: while acme's chats are inside the template (held there by this test), only
    one of them holds a thread and globex's chat still renders. Without the pool each request would
    render in its own thread, as many at once as a tenant sends."""
    from controlplane.registry.models import ModelDeployment
    from controlplane.serving import render_pool
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    assert settings.STRATA_RENDER_THREADS == 2
    globex = tenant_create(actor=actor, slug="globex", name="Globex")
    grant_create(actor=actor, tenant=globex, deployment=ModelDeployment.objects.get(name=MODEL))
    other = api_key_create(actor=actor, tenant=globex)[1]
    entered, leave, lock = [], threading.Event(), threading.Lock()
    real = ChatTemplate.render

    def held_render(self, messages, *args, **kwargs):
        with lock:
            entered.append(messages[0]["content"][:1])
        assert leave.wait(60)
        return real(self, messages, *args, **kwargs)

    def chat(key, letter):
        post(server_url, key, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                    "content": letter * 10}]})

    monkeypatch.setattr(ChatTemplate, "render", held_render)
    senders = [threading.Thread(target=chat, args=(keys["acme"], "a")) for _ in range(3)]
    senders.append(threading.Thread(target=chat, args=(other, "g")))
    try:
        for t in senders[:3]:
            t.start()
        deadline = time.monotonic() + 30

        def acme_jobs() -> int:
            return sum(render_pool._pools[loop].busy(keys["tenant"].pk) for loop in list(render_pool._pools))

        # all three of acme's chats in the pool (each admitted in its own thread, in no set order)
        while (not entered or acme_jobs() < 3) and time.monotonic() < deadline:
            time.sleep(0.01)
        senders[3].start()
        while "g" not in entered and time.monotonic() < deadline:
            time.sleep(0.01)
        with lock:
            assert sorted(entered) == ["a", "g"], entered  # acme's other two wait without a thread
        assert acme_jobs() == 3
    finally:
        leave.set()
        for t in senders:
            t.join(timeout=60)
