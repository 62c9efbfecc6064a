"""The suite's name for ``bench._checkpoints`` (small random Hugging Face checkpoints), which
``python -m bench.make_checkpoint`` also uses outside the tests, and ``sparse_llama_checkpoint``
(a large sparse checkpoint, for the background digest tests)."""

from pathlib import Path

from bench._checkpoints import (  # noqa: F401
    CHATML,
    CORPUS,
    KINDS,
    SPECIALS,
    VLLM_CPU_SHAPE,
    VLLM_ONLY_KINDS,
    build_checkpoint,
    train_tokenizer,
)


def sparse_llama_checkpoint(path: Path, *, weight_bytes: int, dim: int = 2048, ffn: int = 5632, heads: int = 16,
                            shards: int = 2) -> int:
    """A Llama checkpoint of about ``weight_bytes`` of float32 weights (all zero), written as sparse
    files (safetensors headers, then a hole up to each file's size), sharded with an index as Hugging
    Face saves large models, with ``train_tokenizer``'s tokenizer: as big as a real one to hash and to
    validate, without writing the bytes. Returns the weight files' total size."""
    import json
    import struct

    tokenizer = train_tokenizer()
    per_layer = 4 * dim * dim + 3 * dim * ffn + 2 * dim
    vocab = len(tokenizer)
    layers = max(1, (weight_bytes // 4 - 2 * vocab * dim - dim) // per_layer)
    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, dim])]
    for i in range(layers):
        pre = f"model.layers.{i}"
        tensors += [(f"{pre}.self_attn.{p}_proj.weight", [dim, dim]) for p in "qkvo"]
        tensors += [(f"{pre}.mlp.gate_proj.weight", [ffn, dim]), (f"{pre}.mlp.up_proj.weight", [ffn, dim]),
                    (f"{pre}.mlp.down_proj.weight", [dim, ffn]), (f"{pre}.input_layernorm.weight", [dim]),
                    (f"{pre}.post_attention_layernorm.weight", [dim])]
    tensors += [("model.norm.weight", [dim]), ("lm_head.weight", [vocab, dim])]
    path.mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(tensors) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for name, shape in tensors[s * per_shard:(s + 1) * per_shard]:
            size = 4
            for n in shape:
                size *= n
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            weight_map[name] = fname
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with (path / fname).open("wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + offset)
        total += 8 + len(raw) + offset
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": dim,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": heads, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 0,
              "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"), "hidden_act": "silu"}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return total
