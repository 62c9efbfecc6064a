"""The whole platform on a Hugging Face checkpoint directory: created through the admin API with a
``path``, served by a real Ray worker through uvicorn to the official openai client, with the
checkpoint's own tokenizer and chat template, exact cache reuse, stop sequences and its context
length."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest
import torch

from tests.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")

TEXT = ("The quick brown fox jumps over the lazy dog. A cache keeps the attention keys and values of prompts "
        "that many requests share. ")
SYSTEM = "Tenants never read, probe or evict each other's cache entries. " * 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-serve")
    hf, tok = build_checkpoint("llama", path, seed=21, max_pos=512)
    return path, hf, tok


@pytest.fixture
def served(asgi_url, transactional_db, actor, admin_client, checkpoint):
    import ray

    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create
    from workers import actor as worker_actor

    path, hf, tok = checkpoint
    name = f"hf-llama-{secrets.token_hex(3)}"
    admin = {"Authorization": f"Bearer {admin_client.token}"}
    created = httpx.post(f"{asgi_url}/api/admin/models", headers=admin, timeout=60,
                         json={"name": name, "revision": {"label": "r1", "path": str(path)}})
    assert created.status_code == 201, created.text
    from controlplane.registry.models import ModelDeployment

    deployment = ModelDeployment.objects.get(name=name)
    tenant = tenant_create(actor=actor, slug="hf-acme", name="HF Acme")
    grant_create(actor=actor, tenant=tenant, deployment=deployment)
    key = api_key_create(actor=actor, tenant=tenant)[1]
    client = openai.OpenAI(base_url=f"{asgi_url}/v1", api_key=key, max_retries=0, timeout=120)
    yield name, created.json(), client, hf, tok
    handle = worker_actor.find(name)
    if handle is not None:
        ray.kill(handle)


def _generate(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_checkpoint_model_is_created_from_its_config(served, checkpoint):
    from cachecore.model.hf_weights import checkpoint_digest

    _, body, *_ = served
    path = checkpoint[0]
    assert body["preset"] == "" and body["architecture"] == "llama" and body["tokenizer"] == "hf"
    (revision,) = body["revisions"]
    assert revision["source"] == "checkpoint" and revision["path"] == str(path.resolve())
    assert revision["digest"] == checkpoint_digest(path.resolve())
    assert revision["seed"] is None and revision["weights_path"] is None


def test_completion_equals_transformers_and_the_repeat_is_served_from_cache(served):
    name, _, client, hf, tok = served
    ids = tok(TEXT)["input_ids"]
    expected = tok.decode(_generate(hf, ids, 10), skip_special_tokens=True)
    first = client.completions.create(model=name, prompt=TEXT, max_tokens=10, temperature=0)
    second = client.completions.create(model=name, prompt=TEXT, max_tokens=10, temperature=0)
    assert first.usage.prompt_tokens == len(ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert first.choices[0].text == second.choices[0].text == expected


def test_chat_uses_the_checkpoint_template_and_the_second_turn_hits(served):
    name, _, client, hf, tok = served
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello world!"}]
    prompt_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    turn1 = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    assert turn1.usage.prompt_tokens == len(prompt_ids)
    assert turn1.usage.prompt_tokens_details.cached_tokens == 0
    generated = _generate(hf, prompt_ids, 8)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    generated = generated[:generated.index(eos) + 1] if eos in generated else generated
    assert turn1.choices[0].message.content == tok.decode(generated, skip_special_tokens=True)
    messages += [{"role": "assistant", "content": turn1.choices[0].message.content},
                 {"role": "user", "content": "How are you today?"}]
    turn2 = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)
    assert turn2.usage.prompt_tokens_details.cached_tokens >= len(prompt_ids) // 16 * 16 > 0


def test_stop_sequence_ends_the_completion_before_it(served):
    name, _, client, _, _ = served
    whole = client.completions.create(model=name, prompt=TEXT, max_tokens=16, temperature=0).choices[0]
    stop = whole.text[5:8]
    assert stop and whole.finish_reason == "length"
    cut = client.completions.create(model=name, prompt=TEXT, max_tokens=16, temperature=0, stop=[stop, "never"])
    assert cut.choices[0].text == whole.text[:whole.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 16
    streamed = list(client.completions.create(model=name, prompt=TEXT, max_tokens=16, temperature=0, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=name, prompt=TEXT, max_tokens=4, stop=["a", "b", "c", "d", "e"])


def test_context_length_comes_from_the_checkpoint_config(served):
    name, _, client, _, tok = served
    n = len(tok(TEXT)["input_ids"])
    ok = client.completions.create(model=name, prompt=TEXT, max_tokens=512 - n, temperature=0, stop="e")
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=TEXT, max_tokens=512 - n + 1)
    assert "context length of 512" in str(err.value)
