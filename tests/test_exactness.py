"""Proof that reuse is exact: logits and greedy outputs with a cached prefix equal from-scratch ones."""

from __future__ import annotations

import secrets

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("exact-llama", "tiny", RevisionSpec(label="r1", seed=3), device="cpu")


@pytest.fixture
def gen(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=256, device="cpu")
    return CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="exact-llama", revision="r1")


@pytest.fixture
def ns(loaded):
    return loaded.namespace(secrets.token_bytes(32))


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _dense_last(loaded, tokens):
    with torch.inference_mode():
        return loaded.model.forward_dense(torch.tensor(tokens))[-1].float()


@pytest.mark.parametrize("length", [1, 5, 15, 16, 17, 31, 32, 33, 48, 63, 100])
@pytest.mark.parametrize("cached", ["none", "part", "all_but_last"])
def test_logits_with_cached_prefix_equal_from_scratch(loaded, gen, ns, length, cached):
    tokens = _prompt(length, seed=length)
    if cached == "part":
        keep = (length // 2) // BS * BS
        if keep:
            warm = tokens[:keep] + [(t + 1) % 256 for t in tokens[keep:]] + [7]
            gen.prefill_logits(ns, warm, owner="t")
        expected_hit = keep
    elif cached == "all_but_last":
        gen.prefill_logits(ns, tokens, owner="t")
        expected_hit = (length - 1) // BS * BS
    else:
        expected_hit = 0
    logits, hit = gen.prefill_logits(ns, tokens, owner="t")
    assert hit == expected_hit
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    gen.engine.check_integrity()


@pytest.mark.parametrize("length", [17, 40, 64])
def test_greedy_output_identical_with_and_without_cache(gen, ns, length):
    tokens = _prompt(length, seed=100 + length)
    params = SamplingParams(max_tokens=24)
    cold = gen.complete(ns, tokens, owner="t", params=params, use_cache=False)
    first = gen.complete(ns, tokens, owner="t", params=params)
    warm = gen.complete(ns, tokens, owner="t", params=params)
    assert first.cached_tokens == 0
    assert warm.cached_tokens == (length - 1) // BS * BS > 0
    assert cold.token_ids == first.token_ids == warm.token_ids
    gen.engine.check_integrity()


def test_seeded_sampling_is_reproducible_and_cache_independent(gen, ns):
    tokens = _prompt(40, seed=9)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=1234)
    a = gen.complete(ns, tokens, owner="t", params=params, use_cache=False)
    b = gen.complete(ns, tokens, owner="t", params=params)
    c = gen.complete(ns, tokens, owner="t", params=params)
    other = gen.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=20, temperature=0.8, seed=99))
    assert c.cached_tokens > 0
    assert a.token_ids == b.token_ids == c.token_ids
    assert other.token_ids != a.token_ids


def test_multi_turn_chat_reuses_previous_answer_exactly(loaded, gen, ns):
    chat = [{"role": "system", "content": "Be brief. " * 6}, {"role": "user", "content": "Hello there"}]
    params = SamplingParams(max_tokens=20)
    turn1_prompt = loaded.chat.render(chat)
    turn1 = gen.complete(ns, turn1_prompt, owner="t", params=params)
    chat += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": "And then?"}]
    turn2_prompt = loaded.chat.render(chat)
    # the answer re-encodes to exactly the generated ids, so turn 2 extends turn 1's token sequence
    assert turn2_prompt[: len(turn1_prompt) + len(turn1.token_ids)] == turn1_prompt + turn1.token_ids
    turn2 = gen.complete(ns, turn2_prompt, owner="t", params=params)
    # cached beyond the turn-1 prompt: the KV of the generated answer was cached too
    computed_through = len(turn1_prompt) + len(turn1.token_ids) - 1
    assert turn2.cached_tokens == computed_through // BS * BS
    assert turn2.cached_tokens > len(turn1_prompt) // BS * BS
    cold = gen.complete(ns, turn2_prompt, owner="t", params=params, use_cache=False)
    assert cold.token_ids == turn2.token_ids
    logits, _ = gen.prefill_logits(ns, turn2_prompt, owner="t")
    torch.testing.assert_close(logits, _dense_last(loaded, turn2_prompt), atol=1e-5, rtol=1e-5)


def test_decode_logits_match_dense_after_cached_prefix(loaded, gen, ns):
    tokens = _prompt(37, seed=5)
    gen.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=1))
    out = gen.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=6, logprobs=0))
    full = tokens + out.token_ids[:-1]
    with torch.inference_mode():
        dense = torch.log_softmax(loaded.model.forward_dense(torch.tensor(full)).float()
                                  + gen._allowed.cpu(), dim=-1)
    expected = [float(dense[len(tokens) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_is_exact_at_any_chunk_size(loaded, ns, chunk):
    engine = CacheEngine(loaded.layout, num_blocks=64, device="cpu")
    chunked = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="exact-llama", revision="r1",
                        prefill_chunk=chunk)
    tokens = _prompt(70, seed=chunk)
    logits, hit = chunked.prefill_logits(ns, tokens, owner="t")
    assert hit == 0
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    logits, hit = chunked.prefill_logits(ns, tokens, owner="t")  # the chunked KV is reused exactly too
    assert hit == 64
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    engine.check_integrity()
