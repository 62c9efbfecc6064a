"""What the control plane needs to know about a checkpoint directory, without loading its weights.

``inspect_checkpoint`` validates everything a worker would refuse later (config, tensor names and
shapes from the safetensors headers, tokenizer, chat template) and computes the weight digest that is
recorded with the revision. The tokenizer and template it returns are the ones the worker builds
(``hf_tokenizer.load_text``), so the web process tokenizes a revision's requests exactly as its worker
would.

``inspect_checkpoint(path, engine="vllm")`` inspects a checkpoint that vLLM serves (any architecture,
MoE, Gemma, Phi, quantized...): ``config.json`` is read generically (``read_generic_config``: the
single architecture, vocabulary, context length, layers, KV heads, head size, dtype; the language
model's ``text_config`` of a multimodal config where the top level lacks a field), the tensors are not
checked (vLLM's loader checks them against its own model class), and the tokenizer and chat template
are loaded by the same ``load_text``, so tokenizing, templating and limits work in the web process for
these checkpoints too. The digest is the same ``checkpoint_digest`` either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachecore.layout import KVLayout
from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.digests import check_checkpoint_tensors, checkpoint_digest, weight_files
from cachecore.model.hf_config import (
    CheckpointConfig,
    CheckpointError,
    checkpoint_dir,
    read_config,
    read_config_files,
    token_ids,
)
from cachecore.model.hf_tokenizer import HFTokenizer, load_text

ENGINES = ("strata", "vllm")
_GENERIC_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp32": "float32",
                   "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
# config.json field -> older spellings (GPT-2 style configs), tried in order
_ALIASES = {
    "hidden_size": ("n_embd", "d_model"),
    "num_attention_heads": ("n_head", "num_heads"),
    "num_hidden_layers": ("n_layer", "num_layers"),
    "max_position_embeddings": ("n_positions", "max_sequence_length", "seq_length"),
}


@dataclass(frozen=True)
class GenericModel:
    """The sizes of any architecture's ``config.json`` that the control plane and the web process use:
    the vocabulary and context length (request limits) and the KV shape (``kv_layout``, which bounds
    KV uploads; block size 16)."""

    vocab_size: int
    max_seq_len: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str

    def kv_layout(self, block_size: int = 16) -> KVLayout:
        return KVLayout(num_layers=self.n_layers, num_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                        block_size=block_size, dtype=self.dtype)


@dataclass(frozen=True)
class GenericConfig:
    """``config.json`` read generically (``read_generic_config``). Has the attributes of
    ``CheckpointConfig`` that ``load_text`` and ``CheckpointInfo.layout_key`` read (``model`` with
    ``vocab_size``, ``n_layers``, ``n_kv_heads``, ``head_dim``; ``checkpoint_dtype``, ``bos_token_id``,
    ``eos_token_ids``), so both work on it unchanged."""

    model: GenericModel
    architecture: str  # e.g. "MixtralForCausalLM"
    model_type: str  # config.json's model_type, e.g. "mixtral" (the architecture's name when absent)
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json as read


def _field(cfg: dict[str, Any], key: str) -> Any:
    """``key`` (or an alias of it) at the top level of ``cfg``, else in its ``text_config``."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for source in (cfg, text):
        for name in (key, *_ALIASES.get(key, ())):
            if source.get(name) is not None:
                return source[name]
    return None


def _positive(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = _field(cfg, key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def parse_generic_config(cfg: dict[str, Any], *, eos_override: tuple[int, ...] = ()) -> GenericConfig:
    """``config.json``'s content read for any architecture (see the module docstring). ``max_seq_len``
    is ``max_position_embeddings``; the head size is ``head_dim`` when given, else ``hidden_size //
    num_attention_heads``; ``num_key_value_heads`` defaults to ``num_attention_heads``; the dtype is
    ``dtype``/``torch_dtype`` (float32 when absent). Raises ``CheckpointError`` naming the field."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str) or not archs[0]:
        raise CheckpointError(f"config.json: architectures must list exactly one architecture, got {archs!r}")
    n_heads = _positive(cfg, "num_attention_heads")
    head_dim = _field(cfg, "head_dim")
    if head_dim is None:
        hidden = _positive(cfg, "hidden_size")
        if hidden % n_heads:
            raise CheckpointError(f"config.json: hidden_size {hidden} is not divisible by num_attention_heads "
                                  f"{n_heads} (and there is no head_dim)")
        head_dim = hidden // n_heads
    else:
        head_dim = _positive(cfg, "head_dim")
    stored = _field(cfg, "dtype") or _field(cfg, "torch_dtype") or "float32"
    dtype = _GENERIC_DTYPES.get(str(stored).removeprefix("torch."))
    if dtype is None:
        raise CheckpointError(f"config.json: dtype {stored!r} is not supported; supported: float32, float16, bfloat16")
    model = GenericModel(
        vocab_size=_positive(cfg, "vocab_size"),
        max_seq_len=_positive(cfg, "max_position_embeddings"),
        n_layers=_positive(cfg, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=_positive(cfg, "num_key_value_heads", n_heads),
        head_dim=head_dim,
        dtype=dtype,
    )
    model_type = cfg.get("model_type")
    return GenericConfig(
        model=model,
        architecture=archs[0],
        model_type=model_type if isinstance(model_type, str) and model_type else archs[0],
        checkpoint_dtype=dtype,
        bos_token_id=(token_ids(_field(cfg, "bos_token_id"), "config.json: bos_token_id") or (None,))[0],
        eos_token_ids=eos_override or token_ids(_field(cfg, "eos_token_id"), "config.json: eos_token_id"),
        raw=cfg,
    )


def read_generic_config(path: str | os.PathLike[str]) -> GenericConfig:
    """The checkpoint directory's config read generically, with the EOS ids of
    ``generation_config.json`` when that file exists (they win), as ``read_config`` does. Raises
    ``CheckpointError``."""
    cfg, eos = read_config_files(path)
    return parse_generic_config(cfg, eos_override=eos)


@dataclass(frozen=True)
class CheckpointInfo:
    path: str  # resolved directory
    config: CheckpointConfig | GenericConfig  # GenericConfig for engine "vllm"
    digest: str  # weight digest (digests.checkpoint_digest)
    tokenizer: HFTokenizer
    chat: JinjaChatTemplate

    def layout_key(self) -> tuple[int, int, int, str]:
        """What every revision of one deployment must share (its workers' KV pages are built for it):
        layers, KV heads, head size and stored dtype."""
        m = self.config.model
        return (m.n_layers, m.n_kv_heads, m.head_dim, self.config.checkpoint_dtype)


def inspect_checkpoint(path: str | os.PathLike[str], *, digest: bool = True, engine: str = "strata") -> CheckpointInfo:
    """Validate the checkpoint at ``path`` for ``engine``: ``"strata"`` (Strata's own decoder: its
    architectures, every tensor's name and shape) or ``"vllm"`` (any architecture, config read
    generically, safetensors files present; see the module docstring). ``digest=False`` skips hashing
    the weight files (the web process, which only needs the tokenizer and limits, then reports an
    empty digest). Raises ``CheckpointError`` with the reason."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    root = checkpoint_dir(path)
    if engine == "vllm":
        ckpt: CheckpointConfig | GenericConfig = read_generic_config(root)
        weight_files(root)  # safetensors (single or sharded), which the digest covers
    else:
        ckpt = read_config(root)
        check_checkpoint_tensors(root, ckpt)
    tokenizer, chat = load_text(root, ckpt)  # type: ignore[arg-type]  (GenericConfig has what it reads)
    return CheckpointInfo(path=str(root), config=ckpt, digest=checkpoint_digest(Path(root)) if digest else "",
                          tokenizer=tokenizer, chat=chat)
