"""Load one model revision and build the cache namespace for it.

``LoadedModel`` bundles everything a revision changes: config, weights (as a ``LlamaModel``), the
tokenizer and chat template, and the weight digest. ``namespace(scope_salt, lora_id)`` is the one
place the cache-key fields of a model are gathered, so a field cannot be forgotten at a call site.

A revision is a preset's decoder with seeded weights or a safetensors file (byte tokenizer, ChatML),
or a Hugging Face checkpoint directory, which brings its own config, tokenizer and chat template.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cachecore.device import pick_device
from cachecore.layout import KVLayout
from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.config import ModelConfig, preset
from cachecore.model.hf_config import CheckpointError, checkpoint_dir, read_config, serving_dtype
from cachecore.model.hf_tokenizer import HFTokenizer, load_text
from cachecore.model.hf_weights import load_checkpoint_weights
from cachecore.model.llama import LlamaModel
from cachecore.model.tokenizer import ByteTokenizer, ChatTemplate
from cachecore.model.weights import load_safetensors, seeded_digest, seeded_weights
from cachecore.namespace import Namespace


@dataclass(frozen=True)
class RevisionSpec:
    """Where a revision's weights come from: exactly one of ``seed``, ``weights_path`` (a preset's
    layout) or ``checkpoint_path`` (a Hugging Face checkpoint directory). ``digest``, when given, is
    the digest the control plane recorded: a checkpoint whose bytes no longer match it is refused."""

    label: str
    seed: int | None = None
    weights_path: str | None = None
    checkpoint_path: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.seed, self.weights_path, self.checkpoint_path)) != 1:
            raise ValueError("a revision needs exactly one of seed, weights_path or checkpoint_path")

    @classmethod
    def from_dict(cls, revision: dict) -> RevisionSpec:
        """The control plane's revision dict (``runtime.cluster.revision_source``); its ``lora`` (the
        LoRA settings a vLLM engine on the checkpoint starts with) is not this engine's: ignored."""
        return cls(**{k: v for k, v in revision.items() if k != "lora"})


@dataclass
class LoadedModel:
    name: str
    preset: str
    revision: RevisionSpec
    config: ModelConfig
    model: LlamaModel
    tokenizer: ByteTokenizer | HFTokenizer
    chat: ChatTemplate | JinjaChatTemplate
    weight_digest: str
    block_size: int
    architecture: str = "llama"

    @property
    def layout(self) -> KVLayout:
        return self.config.kv_layout(self.block_size)

    def namespace(
        self, scope_salt: bytes, *, lora_id: str = "", tp_rank: int = 0, tp_size: int = 1, origin: str = "model",
    ) -> Namespace:
        """The cache namespace of this revision for one scope (tenant or share group) and origin."""
        return Namespace.build(
            scope_salt=scope_salt,
            model_id=self.name,
            weight_digest=self.weight_digest,
            tokenizer_digest=self.chat.digest,  # covers the tokenizer digest too
            layout=self.layout.canonical(),
            rope=self.config.rope_canonical(),
            lora_id=lora_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            origin=origin,
        )


def load_model(
    name: str,
    preset_name: str,
    revision: RevisionSpec,
    *,
    device: torch.device | str | None = None,
    block_size: int = 16,
    dtype: str | None = None,
) -> LoadedModel:
    """Build the weights of ``revision`` on ``device`` (CUDA when present unless told otherwise).

    A checkpoint revision ignores ``preset_name`` and runs in ``dtype`` (default: the checkpoint's on
    CUDA, fp32 on CPU; see ``hf_config.serving_dtype``); preset revisions run in ``dtype`` when given,
    else in the preset's dtype.
    Raises ``ValueError`` (``CheckpointError`` for checkpoints) with the reason.
    """
    dev = pick_device(str(device) if device is not None else None)
    if revision.checkpoint_path is not None:
        return load_checkpoint(name, revision, device=dev, block_size=block_size, dtype=dtype)
    config = preset(preset_name)
    if dtype is not None:
        config = replace(config, dtype=dtype)  # validated again by ModelConfig
    if revision.seed is not None:
        weights = seeded_weights(config, model_name=name, revision_label=revision.label, seed=revision.seed)
        digest = seeded_digest(config, model_name=name, revision_label=revision.label, seed=revision.seed)
    else:
        weights, digest = load_safetensors(revision.weights_path, config)
    tokenizer = ByteTokenizer()
    return LoadedModel(
        name=name,
        preset=preset_name,
        revision=revision,
        config=config,
        model=LlamaModel(config, weights, dev),
        tokenizer=tokenizer,
        chat=ChatTemplate(tokenizer),
        weight_digest=digest,
        block_size=block_size,
    )


def load_checkpoint(
    name: str, revision: RevisionSpec, *, device: torch.device, block_size: int = 16, dtype: str | None = None,
) -> LoadedModel:
    """A Hugging Face checkpoint revision: config, weights, tokenizer and chat template from its
    directory. Raises ``CheckpointError``."""
    root: Path = checkpoint_dir(revision.checkpoint_path)
    ckpt = read_config(root)
    config = replace(ckpt.model, dtype=serving_dtype(ckpt.checkpoint_dtype, device, dtype))
    tokenizer, chat = load_text(root, ckpt)
    weights, digest = load_checkpoint_weights(root, ckpt, config.dtype)
    if revision.digest is not None and revision.digest != digest:
        raise CheckpointError(f"checkpoint {str(root)!r} changed since revision {revision.label!r} was "
                              f"created (digest {digest[:12]}, recorded {revision.digest[:12]})")
    return LoadedModel(
        name=name,
        preset="",
        revision=revision,
        config=config,
        model=LlamaModel(config, weights, device),
        tokenizer=tokenizer,
        chat=chat,
        weight_digest=digest,
        block_size=block_size,
        architecture=ckpt.model_type,
    )
