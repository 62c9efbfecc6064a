"""Load one model revision and build the cache namespace for it.

``LoadedModel`` bundles everything a revision changes: config, weights (as a ``LlamaModel``), the
tokenizer and chat template, and the weight digest. ``namespace(scope_salt, lora_id)`` is the one
place the cache-key fields of a model are gathered, so a field cannot be forgotten at a call site.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachecore.device import pick_device
from cachecore.layout import KVLayout
from cachecore.model.config import ModelConfig, preset
from cachecore.model.llama import LlamaModel
from cachecore.model.tokenizer import ByteTokenizer, ChatTemplate
from cachecore.model.weights import load_safetensors, seeded_digest, seeded_weights
from cachecore.namespace import Namespace


@dataclass(frozen=True)
class RevisionSpec:
    """Where a revision's weights come from: exactly one of ``seed`` or ``weights_path``."""

    label: str
    seed: int | None = None
    weights_path: str | None = None

    def __post_init__(self) -> None:
        if (self.seed is None) == (self.weights_path is None):
            raise ValueError("a revision needs exactly one of seed or weights_path")


@dataclass
class LoadedModel:
    name: str
    preset: str
    revision: RevisionSpec
    config: ModelConfig
    model: LlamaModel
    tokenizer: ByteTokenizer
    chat: ChatTemplate
    weight_digest: str
    block_size: int

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
) -> LoadedModel:
    """Build the weights of ``revision`` on ``device`` (CUDA when present unless told otherwise)."""
    config = preset(preset_name)
    dev = pick_device(str(device) if device is not None else None)
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
