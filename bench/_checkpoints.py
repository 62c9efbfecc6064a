"""Small random Hugging Face checkpoints for the parity tests, ``bench.model`` and
``bench.make_checkpoint``, built with transformers and saved with ``save_pretrained`` like any
checkpoint on disk (the tests import them as ``tests.hf_checkpoints``).

Each has a byte-level BPE tokenizer trained here with ``tokenizers`` and a ChatML chat template. The
weights are drawn with a larger spread than transformers' init (std 0.02 gives near-flat logits, where
greedy decoding is decided by rounding noise), and biases and q/k norms are random too so that the
paths they switch on are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A cache keeps the attention keys and values of prompts that many requests share.",
    "Hello world! How are you today? I am fine, thank you.",
    "Tenants never read, probe or evict each other's cache entries.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048.",
    "Ünïcödé text, emoji 🙂 and CJK 漢字 must round-trip.",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% if bos_token is defined and add_bos %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(*, vocab_size: int = 320, bos: bool = True):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) with ChatML specials and template; with ``bos``
    its post-processor prepends ``<s>`` (as Llama's does), without it nothing (as Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="</s>")
    fast.chat_template = CHATML.replace("add_bos", "true" if bos else "false")
    return fast


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# Architectures Strata's own engine refuses (cachecore/model/hf_config.py SUPPORTED_ARCHITECTURES) but vLLM
# serves: MoE (mixtral, qwen3_moe), Gemma (scaled embeddings, (1 + w) norms, GeLU) and Phi-3 (fused
# qkv/gate_up projections). Not in KINDS: the parity tests iterate over KINDS only.
VLLM_ONLY_KINDS = ("mixtral", "qwen3_moe", "gemma", "phi3")
# Shape arguments that vLLM's CPU attention accepts (head size 32, 64, 80, 96, 112, 128, ...; the default
# dim 64 / 4 heads gives 16): dim 128, 2 heads, 1 KV head -> head_dim 64. Pass ``**VLLM_CPU_SHAPE``.
VLLM_CPU_SHAPE = {"dim": 128, "heads": 2, "kv_heads": 1}


def build_checkpoint(kind: str, path: Path, *, seed: int = 0, dim: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 128, max_pos: int = 512, tie: bool = False,
                     max_shard_size: str | None = None, dtype: torch.dtype = torch.float32, experts: int = 4,
                     top_k: int = 2, pad_vocab: int = 0, **extra):
    """Save a random ``kind`` checkpoint (one of ``KINDS`` or ``VLLM_ONLY_KINDS``) with its tokenizer under
    ``path``; returns ``(model, tokenizer)`` (transformers objects, eval mode, fp32). ``max_shard_size``
    shards it; ``extra`` goes into the config (e.g. ``attention_bias=True``). The MoE kinds have
    ``experts`` experts of width ``ffn``, ``top_k`` of them routed per token. For vLLM's CPU build pass
    ``**VLLM_CPU_SHAPE`` (its attention needs head_dim 32, 64, 80, ...). ``pad_vocab`` gives the model that
    many embedding rows past the tokenizer's ids (config ``vocab_size`` = tokenizer size + ``pad_vocab``,
    as Qwen2.5 pads 151,665 tokens to 152,064 rows); random weights make the padded ids as likely as
    the others."""
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tokenizer = train_tokenizer(bos=kind in ("llama", "llama3", "mistral", "mixtral", "gemma", "phi3"))
    common = dict(vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=0,
                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **extra)
    common["vocab_size"] += pad_vocab  # padded embedding rows the tokenizer has no token for
    if kind == "llama":
        config, cls = LlamaConfig(**common, rope_theta=10000.0), LlamaForCausalLM
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config, cls = LlamaConfig(**common, rope_parameters=rope), LlamaForCausalLM
    elif kind == "mistral":
        config, cls = MistralConfig(**common, sliding_window=None), MistralForCausalLM
    elif kind == "qwen2":
        config, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    elif kind == "qwen3":
        config, cls = Qwen3Config(**common, head_dim=2 * dim // heads, use_sliding_window=False), Qwen3ForCausalLM
    elif kind == "mixtral":
        config, cls = MixtralConfig(**common, pad_token_id=tokenizer.pad_token_id, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}, sliding_window=None, num_local_experts=experts,
            num_experts_per_tok=top_k), MixtralForCausalLM
    elif kind == "qwen3_moe":
        config, cls = Qwen3MoeConfig(**common, pad_token_id=tokenizer.pad_token_id, use_sliding_window=False,
                                     num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn,
                                     norm_topk_prob=True, decoder_sparse_step=1), Qwen3MoeForCausalLM
    elif kind == "gemma":  # untied by default (as the others): tied, its sqrt(dim)-scaled embeddings make
        # a random model repeat its last input token
        config, cls = GemmaConfig(**common, pad_token_id=tokenizer.pad_token_id, head_dim=dim // heads,
                                  hidden_act="gelu_pytorch_tanh"), GemmaForCausalLM
    elif kind == "phi3":
        config, cls = Phi3Config(**common, pad_token_id=tokenizer.pad_token_id), Phi3ForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {KINDS + VLLM_ONLY_KINDS}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomize(model, seed)
    if kind == "gemma":  # Gemma's RMSNorm scales by (1 + weight): keep the scale near 1 as for the others
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.sub_(1.0)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=common["eos_token_id"],
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    path.mkdir(parents=True, exist_ok=True)
    saved = model.to(dtype) if dtype != torch.float32 else model
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    saved.save_pretrained(path, **kwargs)
    tokenizer.save_pretrained(path)
    return model.float(), tokenizer
