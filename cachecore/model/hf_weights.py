"""Weights of a Hugging Face checkpoint directory (one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``), renamed to the decoder's names, and the checkpoint's digest.

The digest is sha256 over a canonical manifest: a format tag, the sha256 of ``config.json`` and the
sha256 of every weight file by name. ``checkpoint_digest`` computes it by streaming the files (the
control plane records it when a revision is created); ``load_checkpoint_weights`` computes it from
the very bytes it parses, so the digest a worker reports always describes the weights it serves.
The file listing, the names, the digest and the header check are plain Python in
``cachecore.model.digests`` (the control plane's part, without torch), re-exported here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from cachecore.layout import torch_dtype
from cachecore.model.digests import (  # noqa: F401  (re-exported: this module's API before the split)
    DIGEST_FORMAT,
    IGNORED,
    INDEX,
    SINGLE,
    check_checkpoint_tensors,
    checkpoint_digest,
    hf_to_internal,
    manifest_digest,
    sha256_file,
    weight_files,
)
from cachecore.model.hf_config import CheckpointConfig, CheckpointError
from cachecore.model.weights import validate_weights


def load_checkpoint_weights(
    root: Path, ckpt: CheckpointConfig, dtype: str
) -> tuple[dict[str, torch.Tensor], str]:
    """``(weights under the decoder's names as dtype on CPU, checkpoint digest)``.

    With ``tie_word_embeddings`` the lm head is the embedding (a saved ``lm_head.weight`` is ignored,
    as transformers ignores it). Raises ``CheckpointError`` for unreadable or malformed files and for
    tensors that do not fit the config (missing, unexpected, wrong shape).
    """
    target = torch_dtype(dtype)
    config_sha = sha256_file(root / "config.json")
    file_shas: dict[str, str] = {}
    weights: dict[str, torch.Tensor] = {}
    for fname in weight_files(root):
        try:
            data = (root / fname).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read {fname}: {exc.strerror or exc}") from None
        file_shas[fname] = hashlib.sha256(data).hexdigest()
        try:
            tensors = st_load(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{fname} is not a valid safetensors file: {exc}") from None
        del data
        for name, tensor in tensors.items():
            internal = hf_to_internal(name)
            if internal is None or (internal == "output.weight" and ckpt.tie_word_embeddings):
                continue
            if internal in weights:
                raise CheckpointError(f"tensor {name!r} appears in more than one weight file")
            weights[internal] = tensor.to(target)
    try:
        validate_weights(weights, ckpt.model)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint weights do not fit config.json: {exc}") from None
    if not ckpt.tie_word_embeddings and "output.weight" not in weights:
        raise CheckpointError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    return weights, manifest_digest(config_sha, file_shas)
