"""Weights of a Hugging Face checkpoint directory (one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``), renamed to the decoder's names, and the checkpoint's digest.

The digest is sha256 over a canonical manifest: a format tag, the sha256 of ``config.json`` and the
sha256 of every weight file by name. ``checkpoint_digest`` computes it by streaming the files (the
control plane records it when a revision is created); ``load_checkpoint_weights`` computes it from
the very bytes it parses, so the digest a worker reports always describes the weights it serves.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load

from cachecore.layout import DTYPES
from cachecore.model.hf_config import CheckpointConfig, CheckpointError, read_json
from cachecore.model.weights import OPTIONAL, validate_weights, weight_shapes

DIGEST_FORMAT = "strata-hf-checkpoint-v1"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some older checkpoints saved

_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IN_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attention.w{p}.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
}


def weight_files(root: Path) -> list[str]:
    """The safetensors files of the checkpoint, sorted by name. ``CheckpointError`` when there are none
    or the index names a missing file."""
    if (root / INDEX).is_file():
        index = read_json(root / INDEX, INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{INDEX}: weight_map must be a non-empty object")
        files = sorted({str(f) for f in weight_map.values()})
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise CheckpointError(f"checkpoint {str(root)!r} has neither {SINGLE} nor {INDEX} "
                              "(only safetensors checkpoints are supported)")
    for name in files:
        if "/" in name or "\\" in name or name.startswith(".") or not (root / name).is_file():
            raise CheckpointError(f"{INDEX} names {name!r}, which is not a file in the checkpoint")
    return files


def _manifest_digest(config_sha: str, file_shas: dict[str, str]) -> str:
    manifest = {"format": DIGEST_FORMAT, "config.json": config_sha, "weights": file_shas}
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, streamed in 1 MiB reads."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_digest(root: Path) -> str:
    """The checkpoint's digest (see the module docstring), streaming each file once."""
    files = weight_files(root)
    return _manifest_digest(sha256_file(root / "config.json"), {f: sha256_file(root / f) for f in files})


def check_checkpoint_tensors(root: Path, ckpt: CheckpointConfig) -> None:
    """Names and shapes of every tensor against the config, from the safetensors headers alone (no
    tensor is read): what the control plane checks before it records a revision. Raises
    ``CheckpointError`` like ``load_checkpoint_weights`` would."""
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in weight_files(root):
        try:
            with safe_open(root / fname, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    internal = hf_to_internal(name)
                    if internal is None or (internal == "output.weight" and ckpt.tie_word_embeddings):
                        continue
                    shapes[internal] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{fname} is not a valid safetensors file: {exc}") from None
    expected = weight_shapes(ckpt.model)
    missing = sorted(set(expected) - set(shapes) - OPTIONAL)
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint weights do not fit config.json: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    if not ckpt.tie_word_embeddings and "output.weight" not in shapes:
        raise CheckpointError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise CheckpointError(f"checkpoint tensor for {name!r} has shape {shape}, "
                                  f"config.json needs {expected[name]}")


def hf_to_internal(name: str) -> str | None:
    """The decoder's name for a Hugging Face tensor name (None for buffers that are ignored).
    Unknown names are returned unchanged, so validation reports them as unexpected."""
    if IGNORED.search(name):
        return None
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _IN_LAYER:
        return f"layers.{m.group(1)}.{_IN_LAYER[m.group(2)]}"
    return name


def load_checkpoint_weights(
    root: Path, ckpt: CheckpointConfig, dtype: str
) -> tuple[dict[str, torch.Tensor], str]:
    """``(weights under the decoder's names as dtype on CPU, checkpoint digest)``.

    With ``tie_word_embeddings`` the lm head is the embedding (a saved ``lm_head.weight`` is ignored,
    as transformers ignores it). Raises ``CheckpointError`` for unreadable or malformed files and for
    tensors that do not fit the config (missing, unexpected, wrong shape).
    """
    target = DTYPES[dtype]
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
    return weights, _manifest_digest(config_sha, file_shas)
