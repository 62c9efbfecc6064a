"""A checkpoint whose model vocabulary is larger than its tokenizer's (padded embedding rows, as in
Qwen2.5), served over HTTP on both engines at temperature 1: the model generates padded ids, every
request succeeds, and the text is what vLLM's detokenizer makes of the generated ids (a padded id adds
nothing), token by token when streamed; prompt ids are checked against the model's vocabulary, not the
tokenizer's, as vLLM checks them."""

from __future__ import annotations

import secrets
import time

import httpx
import openai
import pytest

from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint

pytest.importorskip("transformers")

PAD = 64  # padded rows past the tokenizer's 320 ids: a sixth of the model's vocabulary
REQUESTS, TOKENS = 5, 64
PROMPT = "The quick brown fox jumps over the lazy dog."
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    path = tmp_path_factory.mktemp("padded-vocab")
    _, tok = build_checkpoint("qwen2", path, seed=31, max_pos=512, pad_vocab=PAD, **VLLM_CPU_SHAPE)
    return path, tok


@pytest.fixture(params=["strata", pytest.param("vllm", marks=pytest.mark.slow)])
def served(request, asgi_url, transactional_db, actor, admin_client, padded):
    """``(model name, openai client)`` of the padded checkpoint created over HTTP on each engine."""
    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    if request.param == "vllm":
        pytest.importorskip("vllm")
    name = f"padded-{request.param}-{secrets.token_hex(3)}"
    created = httpx.post(f"{asgi_url}/api/admin/models", headers={"Authorization": f"Bearer {admin_client.token}"},
                         timeout=60, json={"name": name, "engine": request.param,
                                           "revision": {"label": "r1", "path": str(padded[0])}})
    assert created.status_code == 201, created.text
    tenant = tenant_create(actor=actor, slug="padded", name="Padded")
    grant_create(actor=actor, tenant=tenant, deployment=ModelDeployment.objects.get(name=name))
    key = api_key_create(actor=actor, tenant=tenant)[1]
    yield name, openai.OpenAI(base_url=f"{asgi_url}/v1", api_key=key, max_retries=0, timeout=300)
    _kill(name, gateway)


def _kill(name: str, gateway) -> None:
    import ray

    from workers import actor as worker_actor

    gateway.forget(name)
    handle = worker_actor.find(name)
    if handle is not None:
        ray.kill(handle, no_restart=True)


def vllm_deltas(tok, prompt_ids: list[int], ids: list[int]) -> list[str]:
    """What vLLM's ``FastIncrementalDetokenizer`` emits for each generated id: ``tokenizers``'
    ``DecodeStream`` primed with the prompt, special tokens skipped, None (an id that adds no complete
    text yet, or none at all: a padded id) as ""."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
    return [stream.step(tok._tokenizer, i) or "" for i in ids]


def _check(tok, prompt_ids: list[int], ids: list[int], deltas: list[str], text: str) -> None:
    """The streamed (or logprobs') per-token texts are vLLM's; the text is their join and
    transformers' decode of the ids. Strata's one documented difference: an incomplete character at
    the very end comes out as U+FFFD (``workers.stops``), which vLLM leaves out."""
    expected = vllm_deltas(tok, prompt_ids, ids)
    assert len(deltas) == len(ids)
    assert deltas[:-1] == expected[:-1]
    assert deltas[-1].startswith(expected[-1]) and set(deltas[-1][len(expected[-1]):]) <= {"\ufffd"}
    assert text == "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def _first(call):
    """The first request: a replica still starting answers 503 with ``Retry-After``; try again."""
    deadline = time.monotonic() + 240
    while True:
        try:
            return call()
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(float(exc.response.headers.get("Retry-After", "1")))


def _completion(client, name, tok, seed: int) -> list[int]:
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=1.0, seed=seed,
                                    logprobs=1, extra_body=IDS)
    choice = out.choices[0]
    ids, prompt_ids = choice.token_ids, choice.prompt_token_ids
    assert prompt_ids == tok(PROMPT)["input_ids"] and out.usage.completion_tokens == len(ids)
    _check(tok, prompt_ids, ids, choice.logprobs.tokens, choice.text)
    for i, logprob, top in zip(ids, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0.0 and len(top) == 1, (i, logprob, top)
    return ids


def _completion_stream(client, name, tok, seed: int) -> list[int]:
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=1.0,
                                            seed=seed, stream=True, extra_body=IDS))
    tokens = [c.choices[0] for c in chunks if c.choices and c.choices[0].token_ids]
    ids = [c.token_ids[0] for c in tokens]
    assert all(len(c.token_ids) == 1 for c in tokens) and chunks[-1].choices[0].finish_reason is not None
    _check(tok, chunks[0].choices[0].prompt_token_ids, ids, [c.text for c in tokens],
           "".join(c.choices[0].text for c in chunks if c.choices))
    return ids


def _chat(client, name, tok, seed: int) -> list[int]:
    messages = [{"role": "user", "content": f"{PROMPT} ({seed})"}]
    out = client.chat.completions.create(model=name, messages=messages, max_tokens=TOKENS, temperature=1.0, seed=seed,
                                         logprobs=True, extra_body=IDS)
    ids = out.choices[0].token_ids
    assert out.prompt_token_ids == tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                           return_dict=False)
    _check(tok, out.prompt_token_ids, ids, [t.token for t in out.choices[0].logprobs.content],
           out.choices[0].message.content)
    return ids


def _chat_stream(client, name, tok, seed: int) -> list[int]:
    messages = [{"role": "user", "content": f"{PROMPT} ({seed})"}]
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=TOKENS, temperature=1.0,
                                                 seed=seed, stream=True, extra_body=IDS))
    tokens = [c.choices[0] for c in chunks if c.choices and c.choices[0].token_ids]
    ids = [c.token_ids[0] for c in tokens]
    _check(tok, chunks[0].prompt_token_ids, ids, [c.delta.content for c in tokens],
           "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    return ids


def test_generated_padded_ids_decode_as_vllm_decodes_them_and_never_fail(served, padded):
    name, client = served
    tok = padded[1]
    _first(lambda: client.completions.create(model=name, prompt=PROMPT, max_tokens=1))
    generated: list[int] = []
    for seed in range(REQUESTS):
        for request in (_completion, _completion_stream, _chat, _chat_stream):
            generated += request(client, name, tok, seed)
    padded_ids = [i for i in generated if i >= len(tok)]
    print(f"{name}: {len(generated)} generated ids, {len(padded_ids)} of them padded")
    assert len(generated) > 2 * REQUESTS * TOKENS  # most of the 4 x 5 requests run to max_tokens
    assert len(padded_ids) > len(generated) // 20, (len(padded_ids), len(generated))  # the case is exercised
    assert max(generated) < len(tok) + PAD


def test_prompt_ids_are_checked_against_the_models_vocabulary_not_the_tokenizers(served, padded):
    name, client = served
    tok = padded[1]
    prompt = [*tok(PROMPT)["input_ids"], len(tok), len(tok) + PAD - 1]  # two padded ids: valid, as in vLLM
    out = _first(lambda: client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=1.0,
                                                   seed=3, extra_body=IDS))
    assert out.choices[0].prompt_token_ids == prompt and out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].text == tok.decode(out.choices[0].token_ids, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=[*prompt, len(tok) + PAD], max_tokens=8)
    assert err.value.response.json()["error"]["code"] == "invalid_prompt"
    assert f"token id {len(tok) + PAD} is outside the vocabulary" in err.value.response.json()["error"]["message"]
