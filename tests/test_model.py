"""Reference model runner: paged forward == dense reference, tokenizer/template, weights and digests."""

from __future__ import annotations

import json

import pytest
import torch

from cachecore.device import pick_device
from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.layout import KVLayout
from cachecore.model.config import PRESETS, ModelConfig, preset
from cachecore.model.llama import LlamaModel, _rope, decode_attention
from cachecore.model.tokenizer import ByteTokenizer, ChatTemplate
from cachecore.model.weights import (
    load_safetensors,
    save_safetensors,
    seeded_digest,
    seeded_weights,
    weight_shapes,
)
from cachecore.pages import KVPages

CFG = preset("tiny")
BS = 16
ATOL = 1e-5
TOL = {"atol": ATOL, "rtol": 1e-6}  # rtol: tied-head logits reach |60|
RECIPE = {"model_name": "tiny-demo", "revision_label": "r1", "seed": 7}


@pytest.fixture(scope="module")
def device() -> torch.device:
    return pick_device()


@pytest.fixture(scope="module")
def model(device) -> LlamaModel:
    return LlamaModel(CFG, seeded_weights(CFG, **RECIPE), device)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _paged(model: LlamaModel, n: int, seed: int = 0) -> tuple[KVPages, torch.Tensor]:
    """Pages poisoned with NaN everywhere and a shuffled, non-contiguous block table for n positions."""
    num_blocks = 3 * (-(-n // BS)) + 2
    pages = KVPages(CFG.kv_layout(BS), num_blocks, model.device)
    pages.poison(torch.arange(num_blocks))  # any read of an unwritten slot would surface as NaN
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: -(-n // BS)]
    return pages, table


@pytest.mark.parametrize("n", [1, 5, BS - 1, BS, BS + 1, 2 * BS, 3 * BS + 7])
def test_paged_forward_equals_dense_with_shuffled_block_table(model, n):
    tokens = _tokens(n, seed=n)
    pages, table = _paged(model, n, seed=n)
    assert not torch.equal(table.sort().values, table) or n <= BS  # really shuffled when it can be
    paged = model.forward(tokens, 0, table, pages)
    dense = model.forward_dense(tokens)
    assert paged.shape == (n, CFG.vocab_size) and paged.dtype == torch.float32
    assert not torch.isnan(paged).any()
    torch.testing.assert_close(paged, dense, **TOL)


@pytest.mark.parametrize("split", [1, 7, BS, BS + 3, 40, 52])
def test_prefill_in_two_chunks_equals_one_shot(model, split):
    n = 53
    tokens = _tokens(n, seed=3)
    pages, table = _paged(model, n, seed=3)
    one_shot = model.forward(tokens, 0, table, pages)
    pages2, table2 = _paged(model, n, seed=4)
    first = model.forward(tokens[:split], 0, table2, pages2)
    second = model.forward(tokens[split:], split, table2, pages2)
    torch.testing.assert_close(torch.cat([first, second]), one_shot, **TOL)
    torch.testing.assert_close(second[-1], model.forward_dense(tokens)[-1], **TOL)
    # both runs left the same KV bytes in the blocks they used
    torch.testing.assert_close(pages2.read_blocks(table2), pages.read_blocks(table), **TOL, equal_nan=True)


def test_decode_one_token_at_a_time_equals_dense(model):
    n, prompt = 2 * BS + 5, 9
    tokens = _tokens(n, seed=5)
    pages, table = _paged(model, n, seed=5)
    logits = [model.forward(tokens[:prompt], 0, table, pages)]
    for pos in range(prompt, n):
        logits.append(model.forward(tokens[pos : pos + 1], pos, table, pages))
    torch.testing.assert_close(torch.cat(logits), model.forward_dense(tokens), **TOL)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 3)])
def test_decode_attention_pairs_each_query_head_with_its_kv_head_and_skips_padding(heads, kv_heads):
    """Grouped decode attention (a KV head's query heads as its query rows) equals attention written out
    with KV heads repeated as ``enable_gqa`` pairs them (query head h on KV head h // group), masked
    positions ignored; pairing the heads the other way (h % kv_heads) gives other values."""
    g = torch.Generator().manual_seed(heads)
    b, length, hd = 3, 37, 16
    q = torch.randn(b, heads, hd, generator=g)
    k, v = torch.randn(b, length, kv_heads, hd, generator=g), torch.randn(b, length, kv_heads, hd, generator=g)
    valid = torch.arange(length)[None, :] < torch.tensor([length, 20, 1])[:, None]  # items 1, 2 padded

    def written_out(pair: torch.Tensor) -> torch.Tensor:
        kr, vr = k[:, :, pair], v[:, :, pair]  # [b, length, heads, hd]
        scores = torch.einsum("bhd,blhd->bhl", q, kr) / hd**0.5
        return torch.einsum("bhl,blhd->bhd", scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1), vr)

    out = decode_attention(q, k, v, valid[:, None, None, :])
    assert out.shape == (b, heads, hd)
    torch.testing.assert_close(out, written_out(torch.arange(heads) // (heads // kv_heads)), **TOL)
    if kv_heads < heads:
        assert not torch.allclose(out, written_out(torch.arange(heads) % kv_heads), **TOL)
    whole = decode_attention(q[:1], k[:1], v[:1])  # nothing padded: no mask
    torch.testing.assert_close(whole, out[:1], **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_turns_each_head_by_its_positions_angles_bit_for_bit(model, dtype):
    """RoPE from ``rope_at``'s factors (one product with the cosines, one with the halves swapped and the
    signed sines) equals the rotation written out half by half in fp32, bit for bit, at a slice of
    positions and at scattered ones (the batched forward's)."""
    hd = CFG.head_dim
    x = torch.randn(5, CFG.n_heads + CFG.n_kv_heads, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    for pos in (torch.arange(300, 305), torch.tensor([9, 0, 511, 3, 77])):
        c, s = model.cos[pos][:, None, :].cpu(), model.sin[pos][:, None, :].cpu()
        x1, x2 = x[..., : hd // 2].float(), x[..., hd // 2 :].float()
        written_out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
        by_slice = model.rope_at(slice(300, 305)) if pos[0] == 300 else model.rope_at(pos.to(model.device))
        got = _rope(x.to(model.device), *by_slice).cpu()
        assert got.dtype == dtype and torch.equal(got, written_out)
        assert not torch.equal(got, x)


def test_cached_prefix_from_other_pages_gives_same_logits(model):
    """KV copied block-by-block into fresh pages (what a cache hit does) serves the suffix exactly."""
    n, hit = 50, 3 * BS
    tokens = _tokens(n, seed=6)
    src, src_table = _paged(model, n, seed=6)
    cold = model.forward(tokens, 0, src_table, src)
    dst, dst_table = _paged(model, n, seed=7)
    dst.write_blocks(dst_table[:3], src.read_blocks(src_table[:3]))
    warm = model.forward(tokens[hit:], hit, dst_table, dst)
    torch.testing.assert_close(warm, cold[hit:], **TOL)


def test_forward_rejects_bad_input(model):
    pages, table = _paged(model, 40)
    with pytest.raises(InvalidPrompt):
        model.forward(torch.tensor([CFG.vocab_size]), 0, table, pages)
    with pytest.raises(InvalidPrompt):
        model.forward(torch.tensor([], dtype=torch.long), 0, table, pages)
    with pytest.raises(PromptTooLong):
        model.forward(_tokens(2), CFG.max_seq_len - 1, table, pages)
    with pytest.raises(ValueError):  # table too short for 40 positions
        model.forward(_tokens(40), 0, table[:2], pages)
    with pytest.raises(ValueError):  # block id beyond the pages
        model.forward(_tokens(4), 0, torch.tensor([pages.num_blocks]), pages)
    half = KVPages(KVLayout(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, BS, "bfloat16"), 4, model.device)
    with pytest.raises(ValueError):
        model.forward(_tokens(4), 0, torch.tensor([0]), half)


def test_any_block_size_works(model):
    tokens = _tokens(21)
    pages = KVPages(CFG.kv_layout(4), 8, model.device)
    table = torch.tensor([5, 0, 7, 2, 6, 1])
    torch.testing.assert_close(model.forward(tokens, 0, table, pages), model.forward_dense(tokens), **TOL)


def test_tied_lm_head_works(device):
    weights = seeded_weights(CFG, **RECIPE)
    del weights["output.weight"]
    model = LlamaModel(CFG, weights, device)
    assert model.tied
    pages, table = _paged(model, 20)
    tokens = _tokens(20)
    torch.testing.assert_close(model.forward(tokens, 0, table, pages), model.forward_dense(tokens), **TOL)


def test_logits_are_not_degenerate(model):
    logits = model.forward_dense(_tokens(64))
    assert logits.std() > 0.3
    assert logits.argmax(-1).unique().numel() > 5  # greedy does not pick one token everywhere


# ---- config ---------------------------------------------------------------------------------------


def test_presets_and_unknown_preset():
    small = preset("small")
    assert small.n_kv_heads < small.n_heads and small.max_seq_len >= 4096
    assert set(PRESETS) >= {"tiny", "small"}
    with pytest.raises(ValueError, match="tiny"):
        preset("huge")
    layout = small.kv_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (12, 2, 64)
    assert json.dumps(small.canonical()) and json.dumps(small.rope_canonical())
    assert all(cfg.vocab_size == ByteTokenizer.vocab_size for cfg in PRESETS.values())


def test_config_validation():
    with pytest.raises(ValueError):
        ModelConfig(vocab_size=260, dim=64, n_layers=2, n_heads=4, n_kv_heads=3, ffn_dim=64, max_seq_len=64)
    with pytest.raises(ValueError):
        ModelConfig(vocab_size=260, dim=60, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=64, max_seq_len=64)


# ---- tokenizer and chat template -----------------------------------------------------------------


def test_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and all(i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode([*ids, tok.eos_id, tok.im_end_id]) == text  # specials skipped
    assert tok.decode([0xFF]) == "\ufffd"
    assert tok.encode("<|im_start|>", add_bos=False) == list(b"<|im_start|>")  # no forged specials
    with pytest.raises(InvalidPrompt):
        tok.decode([tok.vocab_size])


def test_generatable_ids_round_trip_through_json_and_reencoding():
    tok = ByteTokenizer()
    gen = tok.generatable_ids()
    assert tok.eos_id in gen and 10 in gen and tok.bos_id not in gen and len(gen) == 97
    ids = [i for i in gen if i != tok.eos_id] * 2
    text = json.loads(json.dumps(tok.decode(ids)))
    assert tok.encode(text, add_bos=False) == ids


def test_chat_template_render():
    tmpl = ChatTemplate()
    tok = tmpl.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tmpl.render(msgs)
    expected = (
        "<S><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    pretty = "".join(
        {tok.bos_id: "<S>", tok.im_start_id: "<|im_start|>", tok.im_end_id: "<|im_end|>"}.get(i, chr(i))
        for i in ids
    )
    assert pretty == expected
    without = tmpl.render(msgs, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(ids) > len(without)
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert tmpl.render(parts) == tmpl.render([msgs[1]])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user"}],
        ["user: hi"],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ],
)
def test_chat_template_rejects_bad_messages(messages):
    with pytest.raises(InvalidPrompt):
        ChatTemplate().render(messages)


def test_tokenizer_and_template_digests_are_stable_hex():
    assert ByteTokenizer().digest == ByteTokenizer().digest and len(ByteTokenizer().digest) == 64
    assert ChatTemplate().digest == ChatTemplate().digest
    assert ChatTemplate().digest != ByteTokenizer().digest


# ---- weights and digests --------------------------------------------------------------------------


def test_seeded_weights_are_deterministic_and_differ_by_recipe():
    a, b = seeded_weights(CFG, **RECIPE), seeded_weights(CFG, **RECIPE)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for change in ({"seed": 8}, {"revision_label": "r2"}, {"model_name": "other"}):
        c = seeded_weights(CFG, **(RECIPE | change))
        assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    assert set(a) == set(weight_shapes(CFG))


def test_seeded_digest_is_stable_and_changes_with_every_recipe_field():
    d = seeded_digest(CFG, **RECIPE)
    assert d == seeded_digest(CFG, **RECIPE) and len(d) == 64
    others = {
        seeded_digest(CFG, **(RECIPE | {"seed": 8})),
        seeded_digest(CFG, **(RECIPE | {"revision_label": "r2"})),
        seeded_digest(CFG, **(RECIPE | {"model_name": "other"})),
        seeded_digest(preset("small"), **RECIPE),
    }
    assert d not in others and len(others) == 4
    with pytest.raises(ValueError):
        seeded_digest(CFG, model_name="m", revision_label="r", seed="7")


def test_safetensors_round_trip_keeps_digest_and_outputs(tmp_path, model, device):
    path = tmp_path / "w.safetensors"
    save_safetensors(seeded_weights(CFG, **RECIPE), path)
    w1, d1 = load_safetensors(path, CFG)
    w2, d2 = load_safetensors(path, CFG)
    assert d1 == d2 and len(d1) == 64 and d1 != seeded_digest(CFG, **RECIPE)
    loaded = LlamaModel(CFG, w1, device)
    tokens = _tokens(30)
    assert torch.equal(loaded.forward_dense(tokens), model.forward_dense(tokens))
    save_safetensors(seeded_weights(CFG, **(RECIPE | {"seed": 8})), path)
    assert load_safetensors(path, CFG)[1] != d1


def test_bad_weights_file_raises_clear_value_error(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a valid safetensors"):
        load_safetensors(garbage, CFG)
    with pytest.raises(ValueError, match="cannot read"):
        load_safetensors(tmp_path / "missing.safetensors", CFG)
    weights = seeded_weights(CFG, **RECIPE)
    path = tmp_path / "w.safetensors"
    save_safetensors({k: v for k, v in weights.items() if k != "norm.weight"}, path)
    with pytest.raises(ValueError, match="missing"):
        load_safetensors(path, CFG)
    save_safetensors(weights | {"layers.0.attention.wq.weight": torch.zeros(3, 3)}, path)
    with pytest.raises(ValueError, match="shape"):
        load_safetensors(path, CFG)
    save_safetensors(weights | {"extra.weight": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="unexpected"):
        load_safetensors(path, CFG)
    save_safetensors(seeded_weights(preset("tiny"), **RECIPE), path)
    with pytest.raises(ValueError):
        load_safetensors(path, preset("small"))
