"""The serving API through the official openai client, against uvicorn + a real local Ray cluster."""

from __future__ import annotations

import httpx
import pytest

DOC = "Strata keeps the attention KV of shared prompt prefixes. " * 6


@pytest.fixture
def platform(engine_platform):
    """Every test here runs on both engines (``engine_platform``)."""
    return engine_platform


def test_completion_then_shared_prefix_reports_cached_tokens_and_same_output(platform):
    client = platform.client("acme")
    first = client.completions.create(model=platform.model, prompt=DOC + "Q1", max_tokens=8, temperature=0)
    second = client.completions.create(model=platform.model, prompt=DOC + "Q1", max_tokens=8, temperature=0)
    if platform.engine == "strata":
        assert first.usage.prompt_tokens == len(DOC) + 3  # bytes + BOS
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    bs = platform.block_size
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // bs * bs > 0
    assert second.choices[0].text == first.choices[0].text
    assert first.usage.completion_tokens == 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + 8


def test_greedy_output_identical_with_and_without_cached_prefix(platform):
    client = platform.client("acme")
    cold = client.completions.create(model=platform.model, prompt=DOC + "cold", max_tokens=12, temperature=0,
                                     extra_body={"cache_salt": "fresh-salt-1"})
    warm_prefix = client.completions.create(model=platform.model, prompt=DOC + "other", max_tokens=1,
                                            temperature=0, extra_body={"cache_salt": "fresh-salt-2"})
    hit = client.completions.create(model=platform.model, prompt=DOC + "cold", max_tokens=12, temperature=0,
                                    extra_body={"cache_salt": "fresh-salt-2"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm_prefix.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    assert hit.choices[0].text == cold.choices[0].text


def test_chat_completion_and_multi_turn_reuse(platform):
    client = platform.client("globex")
    messages = [{"role": "system", "content": "You are terse. " * 10}, {"role": "user", "content": "Hi"}]
    turn1 = client.chat.completions.create(model=platform.model, messages=messages, max_tokens=10, temperature=0)
    answer = turn1.choices[0].message.content
    assert turn1.choices[0].message.role == "assistant"
    assert turn1.object == "chat.completion"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More"}]
    turn2 = client.chat.completions.create(model=platform.model, messages=messages, max_tokens=4, temperature=0)
    # the previous answer's KV was cached too: the hit reaches past the turn-1 prompt
    bs = platform.block_size
    assert turn2.usage.prompt_tokens_details.cached_tokens >= turn1.usage.prompt_tokens // bs * bs


def test_streaming_chat_yields_chunks_that_equal_the_whole_answer(platform):
    client = platform.client("acme")
    messages = [{"role": "user", "content": "stream me " * 5}]
    whole = client.chat.completions.create(model=platform.model, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=platform.model, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 12
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt as the call above


def test_streaming_completion_sends_each_token_as_its_own_event(platform):
    with httpx.stream("POST", f"{platform.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                      json={"model": platform.model, "prompt": "abc", "max_tokens": 5, "stream": True,
                            "temperature": 0}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 5 + 1 + 1  # five tokens, the finish chunk, [DONE]


def test_logprobs_seed_and_temperature(platform):
    client = platform.client("acme")
    a = client.completions.create(model=platform.model, prompt="seeded", max_tokens=10, temperature=0.9, seed=42,
                                  logprobs=2)
    b = client.completions.create(model=platform.model, prompt="seeded", max_tokens=10, temperature=0.9, seed=42)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.token_logprobs) == 10 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=platform.model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2


def test_token_id_prompt_is_accepted(platform):
    client = platform.client("acme")
    out = client.completions.create(model=platform.model, prompt=[256, 72, 105, 33], max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == 4


def test_return_token_ids_gives_the_prompt_and_generated_ids_as_vllm_does(platform):
    from controlplane.serving.model_facts import model_facts

    tokenizer = model_facts(platform.deployment).tokenizer
    client = platform.client("acme")
    plain = client.completions.create(model=platform.model, prompt="Hi", max_tokens=3, temperature=0)
    assert getattr(plain.choices[0], "token_ids", None) is None
    out = client.completions.create(model=platform.model, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode("Hi") and len(choice.token_ids) == 3
    assert choice.text == tokenizer.decode(choice.token_ids) == plain.choices[0].text
    chunks = list(client.completions.create(model=platform.model, prompt="Hi", max_tokens=3, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == tokenizer.encode("Hi")
    assert [i for c in chunks if c.choices for i in c.choices[0].token_ids] == choice.token_ids
    chat = client.chat.completions.create(model=platform.model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2, temperature=0, extra_body={"return_token_ids": True})
    assert chat.usage.prompt_tokens == len(chat.prompt_token_ids) and len(chat.choices[0].token_ids) == 2


def test_models_lists_only_granted_models(platform, actor):
    from controlplane.registry.services import model_create

    model_create(actor=actor, name="not-granted", preset="tiny", revision={"label": "r1", "seed": 1})
    ids = [m.id for m in platform.client("acme").models.list().data]
    assert ids == [platform.model]


def test_usage_is_visible_in_admin_stats(platform, admin_client):
    tenant = "acme"
    platform.client(tenant).completions.create(model=platform.model, prompt=DOC, max_tokens=1, temperature=0)
    stats = admin_client.get("/api/admin/stats").json()
    assert stats["totals"]["query_tokens"] > 0
    worker = next(w for w in stats["workers"] if w["model"] == platform.model)
    assert worker["status"] == "ok"
    assert any(r["tenant"] == tenant for r in stats["tenants"])


def test_prometheus_metrics_need_operator_credentials_and_show_token_counters(platform, admin_client):
    platform.client("acme").completions.create(model=platform.model, prompt=DOC, max_tokens=1, temperature=0)
    assert httpx.get(f"{platform.url}/metrics").status_code == 401
    text = admin_client.get("/metrics").content.decode()
    assert f'strata_worker_up{{model="{platform.model}",replica="0"}} 1.0' in text
    assert f'strata_query_tokens_total{{model="{platform.model}",replica="0",tenant="acme"}}' in text
    assert 'strata_pages{model="' in text and "strata_jobs{" in text
