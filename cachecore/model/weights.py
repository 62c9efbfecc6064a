"""Weights of the reference decoder: seeded (demos, tests) or from a safetensors file.

Each source has a digest that goes into the cache namespace:

- seeded: ``seeded_digest`` hashes the recipe (config, generator version, torch RNG version, model
  name, revision label, seed) without building anything, so the control plane can compute it cheaply
  (it lives in the torch-free ``cachecore.model.digests``, with ``weight_shapes``; re-exported here);
- file: sha256 of the file's bytes (hashed from the same bytes that are parsed, so the digest always
  describes the weights that were loaded).

Tensor names follow Meta's Llama checkpoints (``layers.{i}.attention.wq.weight`` ...), plus
``attention.w{q,k,v,o}.bias`` and ``attention.{q,k}_norm.weight`` when the config has those switches.
The lm head ``output.weight`` is optional: without it the head is tied to ``tok_embeddings.weight``.
Hugging Face checkpoint directories are read by ``cachecore.model.hf_weights``, which maps their names
onto these.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cachecore.layout import torch_dtype
from cachecore.model.config import ModelConfig
from cachecore.model.digests import (  # noqa: F401  (re-exported: this module's API before the split)
    GENERATOR_VERSION,
    OPTIONAL,
    canonical_json,
    check_recipe,
    seeded_digest,
    weight_shapes,
)


def seeded_weights(
    config: ModelConfig, *, model_name: str, revision_label: str, seed: int
) -> dict[str, torch.Tensor]:
    """Deterministic CPU weights of ``config.dtype`` for (model_name, revision_label, seed).

    Drawn from a CPU ``torch.Generator`` seeded by sha256(name, label, seed). Scaled so activations
    stay O(1): embeddings N(0, 1), projections N(0, 1/fan_in), residual outputs (wo, w2) further
    divided by sqrt(2 * n_layers), norms 1; logits then have a spread of about 1 (not degenerate).
    """
    check_recipe(model_name, revision_label, seed)
    material = canonical_json({"model_name": model_name, "revision_label": revision_label, "seed": seed})
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(hashlib.sha256(material).digest()[:8], "big") & (2**63 - 1))
    residual = 1.0 / math.sqrt(2 * config.n_layers)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen)
            if name != "tok_embeddings.weight":
                t /= math.sqrt(shape[1])
            if name.endswith(("wo.weight", "w2.weight")):
                t *= residual
        out[name] = t.to(torch_dtype(config.dtype))
    return out


def validate_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first problem: missing/unexpected names, shapes, non-float."""
    shapes = weight_shapes(config)
    missing = sorted(set(shapes) - set(weights) - OPTIONAL)
    unexpected = sorted(set(weights) - set(shapes))
    if missing:
        raise ValueError(f"weights missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if unexpected:
        raise ValueError(f"weights have {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
    for name, t in weights.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, config needs {shapes[name]}")
        if not t.is_floating_point():
            raise ValueError(f"weight {name!r} has non-float dtype {t.dtype}")


def load_safetensors(
    path: str | os.PathLike[str], config: ModelConfig
) -> tuple[dict[str, torch.Tensor], str]:
    """Load and validate weights for ``config`` from a safetensors file.

    Returns ``(weights as config.dtype on CPU, sha256 hex of the file bytes)``. A missing, unreadable
    or malformed file, or tensors that do not fit ``config``, raise ``ValueError`` with the reason.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read weights file {os.fspath(path)!r}: {exc.strerror or exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    try:
        weights = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{os.fspath(path)!r} is not a valid safetensors file: {exc}") from exc
    validate_weights(weights, config)
    dtype = torch_dtype(config.dtype)
    return {k: v.to(dtype) for k, v in weights.items()}, digest


def save_safetensors(weights: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write ``weights`` to ``path`` atomically (temp file + rename; no half-written file is visible)."""
    # clone: tied tensors share storage, which safetensors refuses to serialise.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}
    blob = st_save(tensors, metadata={"format": "pt"})
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
