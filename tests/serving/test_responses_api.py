"""OpenAI's Responses API (``/v1/responses``) over HTTP with the official openai client, on the
reference engine over a real local Ray (one test on vLLM): create, retrieve, delete, input items,
both streaming styles, a conversation through ``previous_response_id`` whose cached prefix covers the
whole previous turn, tenant isolation, ``store: false``, retention, offboarding, shredding and
clear 4xx errors."""

from __future__ import annotations

import httpx
import openai
import pytest

SYSTEM = "You are the Strata test assistant; answer briefly. " * 4


def _h(platform, tenant="acme"):
    return {"Authorization": f"Bearer {platform.keys[tenant]}"}


def _post(platform, tenant="acme", **body):
    return httpx.post(f"{platform.url}/v1/responses", headers=_h(platform, tenant), timeout=120,
                      json={"model": platform.model, **body})


def _covered(tokens: int, bs: int) -> int:
    """The full blocks of a conversation of ``tokens`` whose last token was sampled, never fed."""
    return (tokens - 1) // bs * bs


def test_create_retrieve_input_items_and_delete(platform):
    client = platform.client("acme")
    r = client.responses.create(model=platform.model, input="Hello there", instructions=SYSTEM,
                                max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == platform.model
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output[0].role == "assistant" and r.output_text == r.output[0].content[0].text
    u = r.usage
    assert u.output_tokens == 8 and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    extra = u.input_tokens_details.model_extra
    assert set(extra["cached_tokens_by_tier"]) == {"l1", "l2", "l3"}
    assert u.input_tokens_details.cache_write_tokens >= 0

    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.input_tokens == u.input_tokens
    items = client.responses.input_items.list(r.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "Hello there")]
    assert items.data[0].id.startswith("msg_")

    assert client.responses.delete(r.id) is None
    from controlplane.audit.models import AuditEvent

    deleted = AuditEvent.objects.get(action="response.delete", target=r.id)
    assert deleted.tenant == "acme" and "Hello" not in str(deleted.new) + str(deleted.old)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(r.id)
    assert missing.value.body["code"] == "response_not_found"
    assert httpx.delete(f"{platform.url}/v1/responses/{r.id}", headers=_h(platform), timeout=30).status_code == 404


def test_message_items_and_input_items_order(platform):
    client = platform.client("acme")
    r = client.responses.create(model=platform.model, max_output_tokens=4, temperature=0, input=[
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "First"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Ok"}]},
        {"role": "user", "content": "Second"}])
    desc = client.responses.input_items.list(r.id)
    assert [i.role for i in desc.data] == ["user", "assistant", "user", "developer"]
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.role for i in asc.data] == ["developer", "user"] and asc.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.last_id)
    assert [i.role for i in rest.data] == ["assistant", "user"] and not rest.has_more
    assert rest.data[0].type == "message" and rest.data[0].content[0].text == "Ok"


def test_streaming_with_create_and_with_the_stream_helper(platform):
    client = platform.client("globex")
    events = list(client.responses.create(model=platform.model, input="Stream me", max_output_tokens=10,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    assert events[-4].text == done.output_text and done.usage.output_tokens == 10
    assert client.responses.retrieve(done.id).output_text == done.output_text

    whole = client.responses.create(model=platform.model, input="Stream me", max_output_tokens=10, temperature=0)
    assert whole.output_text == done.output_text  # greedy: the same answer streamed or whole
    with client.responses.stream(model=platform.model, input="Stream me", max_output_tokens=10,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == done.output_text
    assert final.id != done.id and client.responses.retrieve(final.id).id == final.id


def test_three_turns_through_previous_response_id_reuse_the_whole_previous_turn(platform):
    client = platform.client("acme")
    bs = platform.block_size
    turns, previous = [], None
    for text in ("Tell me about caches.", "And about tiers?", "Thanks, one more?"):
        r = client.responses.create(model=platform.model, input=text, instructions=SYSTEM, max_output_tokens=12,
                                    temperature=0, previous_response_id=previous)
        turns.append(r)
        previous = r.id
    first, second, third = (t.usage for t in turns)
    assert first.input_tokens_details.cached_tokens == 0
    # Each turn's prompt extends the previous prompt and answer exactly, and its cached prefix covers
    # all of them, up to the block granularity.
    for before, after in ((first, second), (second, third)):
        conversation = before.input_tokens + before.output_tokens
        assert after.input_tokens > conversation
        assert after.input_tokens_details.cached_tokens >= _covered(conversation, bs) > before.input_tokens - bs
    assert third.input_tokens_details.cached_tokens > second.input_tokens_details.cached_tokens > 0
    # without previous_response_id, the same text is a new conversation: only the instructions' prefix
    fresh = client.responses.create(model=platform.model, input="And about tiers?", instructions=SYSTEM,
                                    max_output_tokens=4, temperature=0)
    assert fresh.usage.input_tokens_details.cached_tokens < second.input_tokens_details.cached_tokens
    items = client.responses.input_items.list(turns[2].id)
    assert [i.content[0].text for i in items.data] == ["Thanks, one more?"]


def test_a_turn_with_other_instructions_is_rendered_whole(platform):
    from controlplane.conversations.selectors import response_get

    client = platform.client("globex")
    tenant = platform.tenants["globex"]
    first = client.responses.create(model=platform.model, input="Hi", instructions=SYSTEM, max_output_tokens=6,
                                    temperature=0)
    other = client.responses.create(model=platform.model, input="Hi again", instructions="Be brief.",
                                    max_output_tokens=2, temperature=0, previous_response_id=first.id)
    before, after = response_get(tenant, first.id), response_get(tenant, other.id)
    # OpenAI does not carry instructions over: the conversation goes on under the new ones
    assert after["messages"][:2] == [{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": first.output_text}]
    assert after["prompt_ids"][:len(before["prompt_ids"])] != before["prompt_ids"]
    assert other.usage.input_tokens_details.cached_tokens < first.usage.input_tokens


def test_turns_are_in_the_ledger_and_carry_diagnostics_when_asked(platform):
    from controlplane.ledger.selectors import ledger_totals

    client = platform.client("initech")
    first = client.responses.create(model=platform.model, input="Ledger me", instructions=SYSTEM,
                                    max_output_tokens=6, temperature=0, extra_body={"cache_diagnostics": True})
    second = client.responses.create(model=platform.model, input="Again", instructions=SYSTEM, max_output_tokens=6,
                                     temperature=0, previous_response_id=first.id,
                                     extra_headers={"X-Strata-Cache-Diagnostics": "1"})
    diag = first.model_extra["cache_diagnostics"]
    assert diag["cached_tokens"] == 0 and diag["lost"][0]["reason"] == "no_prior_request"
    assert second.model_extra["cache_diagnostics"]["cached_tokens"] == \
        second.usage.input_tokens_details.cached_tokens > 0
    plain = client.responses.create(model=platform.model, input="x", max_output_tokens=2, temperature=0)
    assert "cache_diagnostics" not in plain.model_extra
    totals = ledger_totals(tenant=platform.tenants["initech"], model=platform.model)
    turns = (first.usage, second.usage, plain.usage)
    assert totals.counts["requests"] == 3
    assert totals.counts["prompt_tokens"] == sum(u.input_tokens for u in turns)
    assert totals.counts["completion_tokens"] == sum(u.output_tokens for u in turns)
    assert totals.counts["cached_tokens"] == sum(u.input_tokens_details.cached_tokens for u in turns)


def test_serving_metrics_count_the_route_without_response_ids(platform):
    from controlplane.serving import health

    r = platform.client("acme").responses.create(model=platform.model, input="m", max_output_tokens=2)
    platform.client("acme").responses.retrieve(r.id)
    routes = {s.labels["route"] for m in health.REQUESTS.collect() for s in m.samples}
    assert "/v1/responses" in routes and not any(r.id in route for route in routes)


def test_another_tenants_response_is_a_404_like_a_missing_one(platform):
    mine = platform.client("acme").responses.create(model=platform.model, input="secret", max_output_tokens=4,
                                                    temperature=0)
    other = platform.client("globex")
    bodies = []
    for rid in (mine.id, "resp_" + "0" * 48):
        for call in (lambda: other.responses.retrieve(rid), lambda: other.responses.delete(rid),
                     lambda: other.responses.input_items.list(rid)):
            with pytest.raises(openai.NotFoundError) as err:
                call()
            bodies.append(err.value.body["message"].replace(rid, "<id>"))
        with pytest.raises(openai.NotFoundError) as err:
            other.responses.create(model=platform.model, input="next", previous_response_id=rid, max_output_tokens=2)
        assert err.value.body["code"] == "previous_response_not_found"
    assert bodies[:3] == bodies[3:]
    assert platform.client("acme").responses.retrieve(mine.id).output_text == mine.output_text


def test_store_false_keeps_nothing(platform):
    from controlplane.conversations.models import StoredResponse

    client = platform.client("acme")
    r = client.responses.create(model=platform.model, input="ephemeral", store=False, max_output_tokens=3,
                                temperature=0)
    assert r.output_text is not None and r.model_extra["store"] is False
    assert not StoredResponse.objects.filter(public_id=r.id).exists()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=platform.model, input="more", previous_response_id=r.id, max_output_tokens=2)


def test_stored_responses_are_sealed_under_the_tenants_data_key(platform):
    from controlplane.conversations.models import StoredResponse
    from controlplane.tenants.models import DataKey

    marker = "plaintext-marker-7Q"
    r = platform.client("acme").responses.create(model=platform.model, input=marker, max_output_tokens=3,
                                                 temperature=0)
    row = StoredResponse.objects.get(public_id=r.id)
    active = DataKey.objects.get(tenant=platform.tenants["acme"], state="active")
    assert row.key_version == active.version and marker.encode() not in bytes(row.sealed)
    # a frame moved to another row (or tenant) does not open: it is bound to its id
    other = platform.client("acme").responses.create(model=platform.model, input="x", max_output_tokens=2)
    StoredResponse.objects.filter(public_id=other.id).update(sealed=row.sealed)
    with pytest.raises(openai.NotFoundError):
        platform.client("acme").responses.retrieve(other.id)


def test_retention_expiry_and_the_sweep(platform):
    from datetime import timedelta

    from django.core.management import call_command
    from django.utils import timezone

    from controlplane.conversations.models import StoredResponse
    from controlplane.tenants.models import Tenant

    client = platform.client("acme")
    r = client.responses.create(model=platform.model, input="keep me", max_output_tokens=3, temperature=0)
    row = StoredResponse.objects.get(public_id=r.id)
    assert abs((row.expires_at - row.created).total_seconds() - platform.tenants["acme"].retention_seconds) < 5
    kept = client.responses.create(model=platform.model, input="keep me too", max_output_tokens=3, temperature=0)
    StoredResponse.objects.filter(public_id=r.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=platform.model, input="again", previous_response_id=r.id, max_output_tokens=2)
    call_command("responses_sweep", stdout=(out := __import__("io").StringIO()))
    assert '"responses": 1' in out.getvalue()
    assert not StoredResponse.objects.filter(public_id=r.id).exists()
    assert client.responses.retrieve(kept.id).id == kept.id  # the live one stays
    # a tenant that keeps nothing (retention 0) is answered and stores nothing
    Tenant.objects.filter(slug="acme").update(retention_seconds=0)
    gone = client.responses.create(model=platform.model, input="nothing kept", max_output_tokens=2, temperature=0)
    assert not StoredResponse.objects.filter(public_id=gone.id).exists()


def test_offboarding_deletes_the_tenants_stored_responses(platform, actor):
    from controlplane.conversations.models import StoredResponse
    from controlplane.tenants.services import tenant_offboard

    ids = [platform.client("acme").responses.create(model=platform.model, input=f"turn {i}", max_output_tokens=2,
                                                    temperature=0).id for i in range(2)]
    theirs = platform.client("globex").responses.create(model=platform.model, input="other", max_output_tokens=2)
    assert StoredResponse.objects.filter(public_id__in=ids).count() == 2
    tenant_offboard(actor=actor, tenant=platform.tenants["acme"], reason="test")
    assert not StoredResponse.objects.filter(tenant=platform.tenants["acme"]).exists()
    assert platform.client("globex").responses.retrieve(theirs.id).id == theirs.id


def test_a_shredded_key_version_makes_its_responses_unreadable_and_gone(platform, actor):
    from controlplane.conversations.models import StoredResponse
    from controlplane.tenants.datakeys import data_key_destroy, data_key_rotate, data_key_shred

    client = platform.client("acme")
    tenant = platform.tenants["acme"]
    old = client.responses.create(model=platform.model, input="under v1", max_output_tokens=2, temperature=0)
    v1 = StoredResponse.objects.get(public_id=old.id).key_version
    data_key_rotate(actor=actor, tenant=tenant, reason="test")
    new = client.responses.create(model=platform.model, input="under v2", max_output_tokens=2, temperature=0)
    assert StoredResponse.objects.get(public_id=new.id).key_version == v1 + 1
    assert client.responses.retrieve(old.id).id == old.id  # a retired version still reads
    # the wrapped key deleted (a shred job's first step): the row is there, and can never be opened
    data_key_destroy(actor=actor, tenant=tenant, versions=[v1], reason="test")
    assert StoredResponse.objects.filter(public_id=old.id).exists()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(old.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=platform.model, input="go on", previous_response_id=old.id,
                                max_output_tokens=2)
    data_key_shred(actor=actor, tenant=tenant, version=v1, reason="test")
    assert not StoredResponse.objects.filter(public_id=old.id).exists()
    assert client.responses.retrieve(new.id).id == new.id  # v2's responses are untouched


@pytest.mark.parametrize("body, status, code", [
    ({}, 422, "invalid_value"),
    ({"input": ""}, 422, "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 422, "invalid_value"),
    ({"input": [{"type": "function_call", "role": "user", "content": "x"}]}, 422, "invalid_value"),
    ({"input": "hi", "max_output_tokens": 0}, 422, "invalid_value"),
    ({"input": "hi", "temperature": 3}, 422, "invalid_value"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 422, "invalid_value"),
    ({"input": "hi", "unknown_field": 1}, 422, "invalid_value"),
    ({"input": "hi", "model": "no-such-model"}, 404, "model_not_found"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_not_found"),
])
def test_bad_input_is_a_clear_4xx(platform, body, status, code):
    r = _post(platform, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_bad_json_size_and_count_limits(platform, settings):
    from controlplane.tenants.models import Tenant

    raw = httpx.post(f"{platform.url}/v1/responses", headers={**_h(platform), "Content-Type": "application/json"},
                     content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    Tenant.objects.filter(slug="acme").update(max_prompt_tokens=64)
    big = _post(platform, input="x" * 500)
    assert big.status_code == 413 and big.json()["error"]["code"] == "prompt_too_long"
    listing = httpx.get(f"{platform.url}/v1/responses/x/input_items?limit=0", headers=_h(platform), timeout=30)
    assert listing.status_code == 422
    settings.STRATA_MAX_STORED_RESPONSES = 1
    assert _post(platform, "globex", input="one", max_output_tokens=2).status_code == 200
    full = _post(platform, "globex", input="two", max_output_tokens=2)
    assert full.status_code == 429 and full.json()["error"]["code"] == "too_many_stored_responses"
    assert _post(platform, "globex", input="two", max_output_tokens=2, store=False).status_code == 200
    unauth = httpx.get(f"{platform.url}/v1/responses/resp_x", timeout=30)
    assert unauth.status_code == 401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import build_checkpoint

    path = tmp_path_factory.mktemp("responses-hf")
    hf, tok = build_checkpoint("llama", path, seed=21, max_pos=512)
    return path, tok


@pytest.fixture
def hf_platform(asgi_url, transactional_db, actor, checkpoint):
    """A Hugging Face checkpoint (byte-level BPE, ChatML template that trims contents) on the reference
    engine: generated ids do not re-tokenize to themselves."""
    import ray

    from controlplane.registry.services import model_create
    from tests.serving.conftest import _platform
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name="responses-hf", preset="", revision={"label": "r1",
                                                                                      "path": str(checkpoint[0])})
    yield _platform(asgi_url, actor, deployment)
    handle = worker_actor.find(deployment.name)
    if handle is not None:
        ray.kill(handle)


def test_a_follow_up_continues_from_the_generated_ids_not_their_retokenization(hf_platform, checkpoint):
    from controlplane.conversations.selectors import response_get

    platform, tok = hf_platform, checkpoint[1]
    client = platform.client("acme")
    first = client.responses.create(model=platform.model, input="Hello world! How are you today?",
                                    instructions="Tenants never read each other's cache entries.",
                                    max_output_tokens=24, temperature=0)
    stored = response_get(platform.tenants["acme"], first.id)
    generated = stored["output_ids"]
    # what makes this test bite: the answer's text re-tokenizes to other ids than were generated
    assert tok(first.output_text, add_special_tokens=False)["input_ids"] != generated
    second = client.responses.create(model=platform.model, input="And then?", max_output_tokens=4, temperature=0,
                                     instructions="Tenants never read each other's cache entries.",
                                     previous_response_id=first.id)
    prompt = response_get(platform.tenants["acme"], second.id)["prompt_ids"]
    assert prompt[:len(stored["prompt_ids"]) + len(generated)] == stored["prompt_ids"] + generated
    conversation = first.usage.input_tokens + len(generated)
    assert second.usage.input_tokens_details.cached_tokens >= _covered(conversation, platform.block_size)
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens


@pytest.mark.slow
@pytest.mark.parametrize("engine_platform", ["vllm"], indirect=True)
def test_on_vllm_a_stored_conversation_streams_and_reuses_its_prefix(engine_platform):
    platform = engine_platform
    client = platform.client("acme")
    first = client.responses.create(model=platform.model, input="Hello vLLM " * 8, instructions=SYSTEM,
                                    max_output_tokens=40, temperature=0)
    with client.responses.stream(model=platform.model, input="Go on", instructions=SYSTEM, max_output_tokens=8,
                                 temperature=0, previous_response_id=first.id) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        second = stream.get_final_response()
    assert "".join(deltas) == second.output_text
    conversation = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > conversation
    assert second.usage.input_tokens_details.cached_tokens >= _covered(conversation, platform.block_size) > 0
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
