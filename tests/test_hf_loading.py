"""Loading Hugging Face checkpoint directories: config spellings, refused architectures and settings,
sharded and tied weights, the weight digest, EOS ids, dtypes, and the namespace fields a checkpoint
contributes (a changed template is a new namespace; presets keep theirs)."""

from __future__ import annotations

import json
import secrets
import shutil

import pytest
import torch

from cachecore.errors import InvalidPrompt
from cachecore.model.checkpoint import inspect_checkpoint
from cachecore.model.config import preset
from cachecore.model.hf_config import CheckpointError, parse_config, read_config, serving_dtype
from cachecore.model.hf_weights import checkpoint_digest
from cachecore.model.loader import RevisionSpec, load_model
from tests.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_checkpoint("llama", path, seed=4, layers=1)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def _load(path, **kw):
    return load_model("m", "", RevisionSpec(label="r1", checkpoint_path=str(path), **kw), device="cpu")


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], ["LlamaForCausalLM", "MistralForCausalLM"], None])
def test_unsupported_architecture_is_refused_naming_the_supported_ones(llama_dir, tmp_path, archs):
    path = _copy(llama_dir, tmp_path / "ck")
    _edit_json(path / "config.json", architectures=archs)
    with pytest.raises(CheckpointError) as err:
        read_config(path)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)
    assert read_config(llama_dir).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"torch_dtype": None, "dtype": "int8"}, "int8"),
])
def test_settings_this_decoder_would_compute_differently_are_refused(llama_dir, tmp_path, change, field):
    path = _copy(llama_dir, tmp_path / "ck")
    _edit_json(path / "config.json", **change)
    with pytest.raises(CheckpointError, match=field):
        read_config(path)


def test_transformers_4_and_5_config_spellings_give_the_same_config():
    common = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 1}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v4 = parse_config({**common, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling},
                       "torch_dtype": "bfloat16"})
    v5 = parse_config({**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling},
                       "dtype": "bfloat16"})
    assert v4 == v5
    assert v4.model.rope_scaling.kind == "llama3" and v4.checkpoint_dtype == "bfloat16"
    plain = parse_config({**common, "rope_theta": 5e5})
    assert plain.model.rope_scaling is None and plain.model.rope_canonical() != v4.model.rope_canonical()


def test_sliding_window_caps_the_context_instead_of_changing_attention():
    base = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "max_position_embeddings": 4096, "eos_token_id": 1}
    mistral = parse_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 1024})
    qwen_off = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 1024,
                             "use_sliding_window": False})
    qwen_on = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 1024,
                            "use_sliding_window": True})
    assert mistral.model.max_seq_len == qwen_on.model.max_seq_len == 1024
    assert qwen_off.model.max_seq_len == 4096


def test_missing_directory_files_and_tensors_are_clear_errors(llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        read_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)
    no_tok = _copy(llama_dir, tmp_path / "no-tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        inspect_checkpoint(no_tok)
    no_weights = _copy(llama_dir, tmp_path / "no-weights")
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        inspect_checkpoint(no_weights)
    wrong = _copy(llama_dir, tmp_path / "wrong")
    _edit_json(wrong / "config.json", intermediate_size=96)
    with pytest.raises(CheckpointError, match="shape"):
        inspect_checkpoint(wrong)
    with pytest.raises(CheckpointError, match="shape"):
        _load(wrong)
    assert inspect_checkpoint(llama_dir).config.model.ffn_dim == 128


def test_sharded_checkpoint_loads_the_same_weights_under_another_digest(tmp_path):
    build_checkpoint("qwen2", tmp_path / "one", seed=9, layers=1)
    build_checkpoint("qwen2", tmp_path / "shards", seed=9, layers=1, max_shard_size="50KB")
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 1
    one, shards = _load(tmp_path / "one"), _load(tmp_path / "shards")
    ids = torch.tensor(one.tokenizer.encode("Hello world!"))
    assert torch.equal(one.model.forward_dense(ids), shards.model.forward_dense(ids))
    assert one.weight_digest == checkpoint_digest(tmp_path / "one")
    assert shards.weight_digest == checkpoint_digest(tmp_path / "shards") != one.weight_digest


def test_weight_digest_follows_the_bytes_and_a_recorded_digest_is_verified(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ck")
    recorded = checkpoint_digest(path)
    assert _load(path, digest=recorded).weight_digest == recorded
    weights = path / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(blob))
    assert checkpoint_digest(path) != recorded
    with pytest.raises(CheckpointError, match="changed since"):
        _load(path, digest=recorded)


def test_tied_embeddings_share_the_lm_head(tmp_path):
    build_checkpoint("llama", tmp_path / "tied", tie=True, layers=1)
    build_checkpoint("llama", tmp_path / "untied", tie=False, layers=1)
    tied, untied = _load(tmp_path / "tied"), _load(tmp_path / "untied")
    assert tied.model.tied and tied.model.lm_head is tied.model.tok_emb
    assert not untied.model.tied and untied.model.lm_head is not untied.model.tok_emb


def test_eos_ids_come_from_the_generation_config(llama_dir, tmp_path):
    loaded = _load(llama_dir)
    im_end = loaded.tokenizer.encode("<|im_end|>", add_bos=False)[0]
    assert loaded.tokenizer.eos_ids == frozenset({im_end}) and loaded.tokenizer.eos_id == im_end
    path = _copy(llama_dir, tmp_path / "ck")
    _edit_json(path / "generation_config.json", eos_token_id=[1, im_end])
    several = _load(path).tokenizer
    assert several.eos_ids == frozenset({1, im_end})
    assert several.eos_id == im_end  # the tokenizer's eos_token, which the list names
    assert several.digest != loaded.tokenizer.digest


def test_dtype_is_fp32_on_cpu_unless_configured_and_the_checkpoints_on_cuda(tmp_path):
    build_checkpoint("qwen3", tmp_path / "bf16", layers=1, dtype=torch.bfloat16)
    ckpt = read_config(tmp_path / "bf16")
    assert ckpt.checkpoint_dtype == "bfloat16"
    assert serving_dtype("bfloat16", torch.device("cpu")) == "float32"
    assert serving_dtype("bfloat16", torch.device("cuda")) == "bfloat16"
    assert serving_dtype("float32", torch.device("cuda")) == "float32"
    assert serving_dtype("bfloat16", torch.device("cpu"), "bf16") == "bfloat16"
    with pytest.raises(CheckpointError):
        serving_dtype("float32", torch.device("cpu"), "int4")
    default = _load(tmp_path / "bf16")
    half = load_model("m", "", RevisionSpec(label="r1", checkpoint_path=str(tmp_path / "bf16")), device="cpu",
                      dtype="bfloat16")
    assert default.config.dtype == "float32" and default.model.tok_emb.dtype == torch.float32
    assert half.layout.dtype == "bfloat16" and half.model.tok_emb.dtype == torch.bfloat16


def test_a_changed_chat_template_is_a_new_namespace(llama_dir, tmp_path):
    salt = secrets.token_bytes(32)
    same = _load(llama_dir).namespace(salt).digest, _load(llama_dir).namespace(salt).digest
    assert same[0] == same[1]
    path = _copy(llama_dir, tmp_path / "ck")
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").write_text(template.replace("<|im_start|>assistant", "<|im_start|>assistant "))
    changed = _load(path)
    assert changed.weight_digest == _load(llama_dir).weight_digest  # same weights
    assert changed.namespace(salt).digest != same[0]


def test_presets_keep_their_canonical_config_and_rope_fields():
    tiny = preset("tiny")
    assert set(tiny.canonical()) == {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                     "max_seq_len", "rope_theta", "norm_eps", "dtype"}
    assert tiny.rope_canonical() == {"kind": "rope", "style": "half", "theta": 10000.0, "dim": 16}


def test_template_errors_and_sandbox_escapes_are_invalid_prompts(llama_dir, tmp_path):
    chat = _load(llama_dir).chat
    with pytest.raises(InvalidPrompt, match="unsupported role"):
        chat.render([{"role": "tool", "content": "x"}])  # the template's raise_exception
    with pytest.raises(InvalidPrompt):
        chat.render([])
    path = _copy(llama_dir, tmp_path / "ck")
    (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidPrompt):
        _load(path).chat.render([{"role": "user", "content": "x"}])
    (path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(CheckpointError, match="not valid Jinja"):
        inspect_checkpoint(path)


def test_decode_refuses_ids_outside_the_vocabulary(llama_dir):
    tok = _load(llama_dir).tokenizer
    assert tok.decode(tok.encode("Hello world!", add_bos=False)) == "Hello world!"
    with pytest.raises(InvalidPrompt):
        tok.decode([tok.vocab_size])
    with pytest.raises(InvalidPrompt):
        tok.encode(b"bytes")


def test_padded_ids_decode_to_nothing_as_in_vllm_and_the_model_may_generate_them(tmp_path):
    from tokenizers.decoders import DecodeStream

    _, hf_tok = build_checkpoint("qwen2", tmp_path, seed=4, layers=1, pad_vocab=64)
    loaded = _load(tmp_path)
    tok = loaded.tokenizer
    assert (tok.vocab_size, tok.model_vocab_size, loaded.config.vocab_size) == (320, 384, 384)
    assert tok.generatable_ids() == tuple(range(384))  # vLLM samples from all of the model's logits
    ids = tok.encode("Ünïcödé 🙂 漢字", add_bos=False)
    mixed = [320, *ids[:2], 383, *ids[2:], 350]  # a padded id inside a split character, first and last
    assert tok.decode(mixed) == tok.decode(ids) == "Ünïcödé 🙂 漢字" == hf_tok.decode(mixed, skip_special_tokens=True)
    stream = DecodeStream(skip_special_tokens=True)  # vLLM's detokenizer, token by token
    assert "".join(stream.step(hf_tok._tokenizer, i) or "" for i in mixed) == tok.decode(mixed)
    assert tok.decode([383]) == ""
    with pytest.raises(InvalidPrompt, match="outside the vocabulary"):
        tok.decode([*ids, 384])


def test_serving_a_checkpoint_never_imports_transformers(llama_dir):
    import subprocess
    import sys

    code = ("import sys; from cachecore.model.loader import RevisionSpec, load_model; "
            f"m = load_model('m', '', RevisionSpec(label='r1', checkpoint_path={str(llama_dir)!r}), device='cpu'); "
            "m.chat.render([{'role': 'user', 'content': 'hi'}]); "
            "print('transformers' in sys.modules, 'tokenizers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]
