"""What the control plane needs to know about a checkpoint directory, without loading its weights.

``inspect_checkpoint`` validates everything a worker would refuse later (config, tensor names and
shapes from the safetensors headers, tokenizer, chat template) and computes the weight digest that is
recorded with the revision. The tokenizer and template it returns are the ones the worker builds
(``hf_tokenizer.load_text``), so the web process tokenizes a revision's requests exactly as its worker
would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.hf_config import CheckpointConfig, checkpoint_dir, read_config
from cachecore.model.hf_tokenizer import HFTokenizer, load_text
from cachecore.model.hf_weights import check_checkpoint_tensors, checkpoint_digest


@dataclass(frozen=True)
class CheckpointInfo:
    path: str  # resolved directory
    config: CheckpointConfig
    digest: str  # weight digest (hf_weights.checkpoint_digest)
    tokenizer: HFTokenizer
    chat: JinjaChatTemplate

    def layout_key(self) -> tuple[int, int, int, str]:
        """What every revision of one deployment must share (its workers' KV pages are built for it):
        layers, KV heads, head size and stored dtype."""
        m = self.config.model
        return (m.n_layers, m.n_kv_heads, m.head_dim, self.config.checkpoint_dtype)


def inspect_checkpoint(path: str | os.PathLike[str], *, digest: bool = True) -> CheckpointInfo:
    """Validate the checkpoint at ``path``; ``digest=False`` skips hashing the weight files (the web
    process, which only needs the tokenizer and limits, then reports an empty digest). Raises
    ``CheckpointError`` with the reason."""
    root = checkpoint_dir(path)
    ckpt = read_config(root)
    check_checkpoint_tensors(root, ckpt)
    tokenizer, chat = load_text(root, ckpt)
    return CheckpointInfo(path=str(root), config=ckpt, digest=checkpoint_digest(root) if digest else "",
                          tokenizer=tokenizer, chat=chat)
