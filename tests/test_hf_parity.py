"""Proof against transformers: small random Llama / Llama-3 (RoPE scaling) / Mistral / Qwen2 (bias) /
Qwen3 (q/k norm, explicit head_dim, tied embeddings) checkpoints saved with ``save_pretrained`` and
loaded by Strata give transformers' logits (fp32) with nothing, part or all but the last token
cached, the same greedy tokens as ``generate``, and the same chat prompt ids as
``apply_chat_template``."""

from __future__ import annotations

import json
import secrets
from dataclasses import replace

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.model.llama import LlamaModel
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.pages import KVPages
from cachecore.runner import CompletionRunner, SamplingParams
from tests.hf_checkpoints import KINDS, build_checkpoint

pytest.importorskip("transformers")

BS = 16
ATOL = 1e-4
TEXT = ("The quick brown fox jumps over the lazy dog. A cache keeps the attention keys and values of prompts "
        "that many requests share. Hello world! How are you today? Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.")
CHATS = [
    [{"role": "user", "content": "Hello world!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "How are you today?"},
     {"role": "assistant", "content": "I am fine, thank you."}, {"role": "user", "content": "Ünïcödé 🙂 漢字"}],
    [{"role": "user", "content": [{"type": "text", "text": "The quick "}, {"type": "text", "text": "brown fox"}]}],
]


@pytest.fixture(scope="module", params=KINDS)
def ckpt(request, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    # Sharded for one kind, tied embeddings for another: both layouts are read.
    hf, tok = build_checkpoint(kind, path, seed=KINDS.index(kind), tie=kind == "qwen3",
                               max_shard_size="100KB" if kind == "llama" else None)
    loaded = load_model(f"parity-{kind}", "", RevisionSpec(label="r1", checkpoint_path=str(path)), device="cpu")
    return kind, path, hf, tok, loaded


@pytest.fixture
def gen(ckpt):
    loaded = ckpt[4]
    engine = CacheEngine(loaded.layout, num_blocks=128, device="cpu")
    return CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name=loaded.name, revision="r1")


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _ids(tok, n: int) -> list[int]:
    ids = tok(TEXT * 4)["input_ids"][:n]
    assert len(ids) == n
    return ids


def test_checkpoint_sizes_come_from_config_json(ckpt):
    kind, path, hf, tok, loaded = ckpt
    cfg = json.loads((path / "config.json").read_text())
    assert loaded.config.vocab_size == cfg["vocab_size"] == len(tok)
    assert loaded.config.n_layers == cfg["num_hidden_layers"]
    assert loaded.config.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert loaded.config.qkv_bias == (kind == "qwen2")
    assert loaded.config.qk_norm == (kind == "qwen3")
    assert (loaded.config.rope_scaling is not None) == (kind == "llama3")
    assert loaded.model.tied == (kind == "qwen3")
    assert loaded.architecture == ("llama" if kind == "llama3" else kind)


@pytest.mark.parametrize("length", [17, 40, 64])
@pytest.mark.parametrize("cached", ["none", "part", "all_but_last"])
def test_logits_equal_transformers_with_cached_prefix(ckpt, gen, length, cached):
    tok, hf, loaded = ckpt[3], ckpt[2], ckpt[4]
    ns = loaded.namespace(secrets.token_bytes(32))
    ids = _ids(tok, length)
    if cached == "part":
        keep = (length // 2) // BS * BS
        gen.prefill_logits(ns, ids[:keep] + [(t + 1) % len(tok) for t in ids[keep:]], owner="t")
        expected_hit = keep
    elif cached == "all_but_last":
        gen.prefill_logits(ns, ids, owner="t")
        expected_hit = (length - 1) // BS * BS
    else:
        expected_hit = 0
    logits, hit = gen.prefill_logits(ns, ids, owner="t")
    assert hit == expected_hit
    torch.testing.assert_close(logits, _hf_logits(hf, ids)[-1], atol=ATOL, rtol=ATOL)
    gen.engine.check_integrity()


def test_every_position_of_a_chunked_paged_forward_equals_transformers(ckpt):
    tok, hf, loaded = ckpt[3], ckpt[2], ckpt[4]
    ids = _ids(tok, 70)
    pages = KVPages(loaded.layout, num_blocks=8, device="cpu")
    table = torch.tensor([5, 2, 7, 0, 3])  # scattered blocks: positions go through the block table
    first = loaded.model.forward(torch.tensor(ids[:33]), 0, table, pages)
    rest = loaded.model.forward(torch.tensor(ids[33:]), 33, table, pages)
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(torch.cat([first, rest]), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(loaded.model.forward_dense(torch.tensor(ids)), ref, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("prompt_len", [9, 35])
def test_greedy_generation_equals_transformers_generate_token_for_token(ckpt, gen, prompt_len):
    tok, hf, loaded = ckpt[3], ckpt[2], ckpt[4]
    ids = _ids(tok, prompt_len)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, prompt_len:].tolist()
    ns = loaded.namespace(secrets.token_bytes(32))
    params = SamplingParams(max_tokens=24)
    cold = gen.complete(ns, ids, owner="t", params=params)
    warm = gen.complete(ns, ids, owner="t", params=params)
    assert cold.token_ids == expected
    assert warm.token_ids == expected
    assert (warm.cached_tokens > 0) == (prompt_len > BS)
    assert cold.text == tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_prompt_ids_equal_apply_chat_template(ckpt, chat):
    tok, loaded = ckpt[3], ckpt[4]
    messages = CHATS[chat]
    hf_messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                    else "".join(p["text"] for p in m["content"])} for m in messages]
    expected = tok.apply_chat_template(hf_messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert loaded.chat.render(messages) == expected
    without = tok.apply_chat_template(hf_messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert loaded.chat.render(messages, add_generation_prompt=False) == without != expected


def test_completion_prompt_ids_equal_transformers_encode(ckpt):
    tok, loaded = ckpt[3], ckpt[4]
    for text in (TEXT, "Ünïcödé 🙂 漢字", " leading space", "<|im_start|>user"):
        assert loaded.tokenizer.encode(text) == tok(text)["input_ids"]
        assert loaded.tokenizer.encode(text, add_bos=False) == tok(text, add_special_tokens=False)["input_ids"]
    ids = tok(TEXT)["input_ids"]
    assert loaded.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_llama3_rope_scaling_is_what_makes_the_logits_match(tmp_path):
    hf, tok = build_checkpoint("llama3", tmp_path, seed=11)
    loaded = load_model("rope", "", RevisionSpec(label="r1", checkpoint_path=str(tmp_path)), device="cpu")
    ids = _ids(tok, 64)
    weights = {"tok_embeddings.weight": loaded.model.tok_emb, "norm.weight": loaded.model.norm,
               "output.weight": loaded.model.lm_head}
    for i, layer in enumerate(loaded.model.layers):
        p = f"layers.{i}."
        q, k, v = layer.wqkv.weight.split([loaded.config.n_heads * loaded.config.head_dim,
                                    loaded.config.n_kv_heads * loaded.config.head_dim,
                                    loaded.config.n_kv_heads * loaded.config.head_dim])
        w1, w3 = layer.w13.weight.chunk(2)
        weights.update({p + "attention_norm.weight": layer.attn_norm, p + "ffn_norm.weight": layer.ffn_norm,
                        p + "attention.wq.weight": q, p + "attention.wk.weight": k, p + "attention.wv.weight": v,
                        p + "attention.wo.weight": layer.wo.weight, p + "feed_forward.w1.weight": w1,
                        p + "feed_forward.w3.weight": w3, p + "feed_forward.w2.weight": layer.w2.weight})
    unscaled = LlamaModel(replace(loaded.config, rope_scaling=None), weights, "cpu")
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(loaded.model.forward_dense(torch.tensor(ids)), ref, atol=ATOL, rtol=ATOL)
    assert not torch.allclose(unscaled.forward_dense(torch.tensor(ids)), ref, atol=1e-2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_attention_bias_checkpoints_paged_forward_equals_transformers(tmp_path, kind):
    """``attention_bias`` puts biases on q/k/v and the output projection (``LlamaModel._attn_out``)."""
    hf, tok = build_checkpoint(kind, tmp_path, seed=13, attention_bias=True)
    loaded = load_model("bias", "", RevisionSpec(label="r1", checkpoint_path=str(tmp_path)), device="cpu")
    assert loaded.config.qkv_bias and loaded.config.o_bias
    ids = _ids(tok, 40)
    pages = KVPages(loaded.layout, num_blocks=4, device="cpu")
    table = torch.tensor([3, 1, 0])
    paged = torch.cat([loaded.model.forward(torch.tensor(ids[:20]), 0, table, pages),
                       loaded.model.forward(torch.tensor(ids[20:]), 20, table, pages)])
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(paged, ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(loaded.model.forward_dense(torch.tensor(ids)), ref, atol=ATOL, rtol=ATOL)


def test_attention_bias_checkpoints_serve_transformers_greedy_tokens_through_the_batched_runner(tmp_path):
    """The scheduler's batched forward applies the output-projection bias too (``_attn_out``), cold and
    with the prompt's prefix cached, alone and batched with another request."""
    hf, tok = build_checkpoint("llama", tmp_path, seed=14, attention_bias=True)
    loaded = load_model("bias", "", RevisionSpec(label="r1", checkpoint_path=str(tmp_path)), device="cpu")
    assert loaded.config.o_bias
    ids = _ids(tok, 35)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, 35:].tolist()
    engine = CacheEngine(loaded.layout, num_blocks=128, device="cpu")
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="bias", revision="r1")
    ns = loaded.namespace(secrets.token_bytes(32))
    params = SamplingParams(max_tokens=12)
    cold = gen.complete(ns, ids, owner="t", params=params)
    warm = gen.complete(ns, ids, owner="t", params=params)
    assert cold.token_ids == expected and cold.cached_tokens == 0
    assert warm.token_ids == expected and warm.cached_tokens == 32


def test_bf16_logits_differ_from_transformers_by_no_more_than_bf16_rounding(tmp_path):
    """In bf16 the two implementations round differently; Strata's distance to transformers' bf16
    logits stays within twice transformers' own bf16-vs-fp32 error (and within it of fp32)."""
    hf, tok = build_checkpoint("qwen3", tmp_path, seed=5, dtype=torch.bfloat16)
    loaded = load_model("bf16", "", RevisionSpec(label="r1", checkpoint_path=str(tmp_path)), device="cpu",
                        dtype="bfloat16")
    ids = _ids(tok, 48)
    pages = KVPages(loaded.layout, num_blocks=4, device="cpu")
    ours = loaded.model.forward(torch.tensor(ids), 0, torch.arange(4), pages)
    ref32 = _hf_logits(hf, ids)
    ref16 = _hf_logits(hf.to(torch.bfloat16), ids)
    bf16_error = (ref16 - ref32).abs().max()
    assert 0 < bf16_error < 0.5
    assert (ours - ref16).abs().max() <= 2 * bf16_error
    assert (ours - ref32).abs().max() <= 2 * bf16_error
    assert (ours.argmax(-1) == ref32.argmax(-1)).float().mean() > 0.9
