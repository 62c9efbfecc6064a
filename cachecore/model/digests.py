"""What the control plane computes about a model's weights without loading them (plain Python: no
torch, so the web process can record a revision): the tensor names and shapes a config needs, the
seeded-weights recipe's digest, and a Hugging Face checkpoint's files, digest and header check.

``cachecore.model.weights`` (seeded weights, one safetensors file) and ``cachecore.model.hf_weights``
(checkpoint directories) load the tensors and re-export these names.

The HF digest is sha256 over a canonical manifest: a format tag, the sha256 of ``config.json`` and
the sha256 of every weight file by name. ``checkpoint_digest`` computes it by streaming the files (the
control plane records it when a revision is created); ``hf_weights.load_checkpoint_weights``
computes it from the very bytes it parses, so the digest a worker reports always describes the
weights it serves.
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import metadata
from pathlib import Path

from safetensors import SafetensorError, safe_open

from cachecore.model.config import ModelConfig
from cachecore.model.hf_config import CheckpointConfig, CheckpointError, read_json

# Bump when the order or scaling of seeded draws changes: the same recipe must always mean the
# same weights, or cached KV from the old weights would be served for the new ones.
GENERATOR_VERSION = "strata-seeded-v1"
OPTIONAL = frozenset({"output.weight"})


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, in the (fixed) order seeded weights are drawn."""
    d, hd, f = config.dim, config.head_dim, config.ffn_dim
    q_rows, kv_rows = config.n_heads * hd, config.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, d)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "attention.wq.weight"] = (q_rows, d)
        shapes[p + "attention.wk.weight"] = (kv_rows, d)
        shapes[p + "attention.wv.weight"] = (kv_rows, d)
        shapes[p + "attention.wo.weight"] = (d, q_rows)
        if config.qkv_bias:
            shapes[p + "attention.wq.bias"] = (q_rows,)
            shapes[p + "attention.wk.bias"] = (kv_rows,)
            shapes[p + "attention.wv.bias"] = (kv_rows,)
        if config.o_bias:
            shapes[p + "attention.wo.bias"] = (d,)
        if config.qk_norm:
            shapes[p + "attention.q_norm.weight"] = (hd,)
            shapes[p + "attention.k_norm.weight"] = (hd,)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "feed_forward.w1.weight"] = (f, d)
        shapes[p + "feed_forward.w3.weight"] = (f, d)
        shapes[p + "feed_forward.w2.weight"] = (d, f)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (config.vocab_size, d)
    return shapes


def torch_rng_version() -> str:
    """torch's major.minor as the installed distribution declares it (``torch.__version__`` is built
    from the same string), read without importing torch."""
    return ".".join(metadata.version("torch").split(".")[:2])


def canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def check_recipe(model_name: str, revision_label: str, seed: int) -> None:
    if not isinstance(model_name, str) or not isinstance(revision_label, str):
        raise ValueError("model_name and revision_label must be strings")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def seeded_digest(config: ModelConfig, *, model_name: str, revision_label: str, seed: int) -> str:
    """sha256 hex of the seeded-weights recipe. Cheap: builds no tensor.

    Includes torch's major.minor version: torch does not promise the same random stream across
    releases, and a digest must never name two different sets of weights.
    """
    check_recipe(model_name, revision_label, seed)
    recipe = {
        "source": "seeded",
        "generator": GENERATOR_VERSION,
        "torch_rng": torch_rng_version(),
        "config": config.canonical(),
        "model_name": model_name,
        "revision_label": revision_label,
        "seed": seed,
    }
    return hashlib.sha256(canonical_json(recipe)).hexdigest()


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


def manifest_digest(config_sha: str, file_shas: dict[str, str]) -> str:
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
    return manifest_digest(sha256_file(root / "config.json"), {f: sha256_file(root / f) for f in files})


def check_checkpoint_tensors(root: Path, ckpt: CheckpointConfig) -> None:
    """Names and shapes of every tensor against the config, from the safetensors headers alone (no
    tensor is read): what the control plane checks before it records a revision. Raises
    ``CheckpointError`` like ``load_checkpoint_weights`` would."""
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in weight_files(root):
        try:
            with safe_open(root / fname, framework="numpy") as f:  # headers only: no torch
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
