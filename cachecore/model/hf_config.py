"""A Hugging Face checkpoint's ``config.json`` as a ``ModelConfig``.

Supported: the architectures that share the Llama decoder with a config switch —
``LlamaForCausalLM`` (Llama 1/2/3, ``attention_bias``, Llama 3 RoPE scaling), ``MistralForCausalLM``,
``Qwen2ForCausalLM`` (q/k/v bias) and ``Qwen3ForCausalLM`` (q/k norm). Both spellings transformers has
written are read: ``rope_theta`` + ``rope_scaling`` + ``torch_dtype`` (4.x) and ``rope_parameters`` +
``dtype`` (5.x). Anything this decoder would compute differently from transformers (another
activation, MLP biases, a RoPE type other than default/linear/llama3) is refused with
``CheckpointError`` naming the field, never approximated.

Sliding-window attention (Mistral's ``sliding_window``, Qwen's ``use_sliding_window``) equals full
attention while the context fits in the window, so such a model's ``max_seq_len`` is capped at the
window rather than computed differently.

Confinement: inside ``weights_root(root)`` (the control plane and the workers enter it with
``STRATA_WEIGHTS_ROOT``) a checkpoint directory, and every file in it, must resolve inside ``root``
with symlinks followed, or ``checkpoint_dir`` refuses it (``CheckpointError``): a checkpoint only
opens files at its top level, so none of them can lead a reader outside the root.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachecore.model.config import ModelConfig, RopeScaling

if TYPE_CHECKING:  # plain Python: the control plane reads checkpoint configs without torch
    import torch

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: missing or malformed files, or an architecture or
    setting this decoder does not implement. The message says which file or field and why."""


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``config.json`` says: the decoder config (with ``dtype`` as stored in the checkpoint) and
    the facts the loader needs besides it."""

    model: ModelConfig
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    tie_word_embeddings: bool
    checkpoint_dtype: str  # dtype the weights are stored in
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``CheckpointError`` if missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what}: {os.fspath(path)} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what}: cannot read {os.fspath(path)}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {os.fspath(path)} must hold a JSON object")
    return data


_WEIGHTS_ROOT: ContextVar[Path | None] = ContextVar("strata_weights_root", default=None)


@contextmanager
def weights_root(root: str | os.PathLike[str] | None) -> Iterator[None]:
    """Confine every checkpoint read in this context (thread or task) to ``root`` (``None``: no
    confinement, the default)."""
    token = _WEIGHTS_ROOT.set(Path(root).expanduser().resolve() if root else None)
    try:
        yield
    finally:
        _WEIGHTS_ROOT.reset(token)


def _confine(directory: Path) -> None:
    """``CheckpointError`` unless ``directory`` and each of its entries resolve inside the current
    weights root. Names the entry, never where it points."""
    root = _WEIGHTS_ROOT.get()
    if root is None:
        return
    if not directory.is_relative_to(root):
        raise CheckpointError(f"checkpoint path {str(directory)!r} is outside the weights root {str(root)!r}")
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        raise CheckpointError(f"cannot list the checkpoint directory: {exc.strerror or exc}") from None
    for entry in entries:
        if not entry.resolve().is_relative_to(root):
            raise CheckpointError(f"checkpoint file {entry.name!r} resolves outside the weights root "
                                  f"{str(root)!r} (a symlink out of it); refused")


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` resolved, or ``CheckpointError`` when it is not a directory with a ``config.json``, or
    when it or a file in it resolves outside the current ``weights_root``."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {os.fspath(path)!r} is not a directory")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"checkpoint path {os.fspath(path)!r} has no config.json")
    resolved = p.resolve()
    _confine(resolved)
    return resolved


def token_ids(value: Any, what: str) -> tuple[int, ...]:
    """An ``eos_token_id``-style field (int, list of ints or null) as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(f"{what} must be a token id or a list of them, got {value!r}")
    return tuple(items)


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CheckpointError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta, scaling = params.get("rope_theta", cfg.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    theta = _float({"rope_theta": theta}, "rope_theta", 10000.0)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"config.json: rope scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    try:
        if kind == "linear":
            return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
        if kind == "llama3":
            return theta, RopeScaling(
                kind="llama3", factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]), high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json: rope scaling {kind!r} is incomplete or invalid: {exc}") from None
    raise CheckpointError(f"config.json: rope type {kind!r} is not supported; supported: default, linear, llama3")


def _window(cfg: dict[str, Any], model_type: str) -> int | None:
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    if window is None:
        return None
    return _int(cfg, "sliding_window")


def parse_config(cfg: dict[str, Any], *, eos_override: tuple[int, ...] = ()) -> CheckpointConfig:
    """``config.json``'s content as a ``CheckpointConfig``. ``eos_override``: the generation config's
    EOS ids, which win over config.json's. Raises ``CheckpointError`` (see the module docstring)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"config.json: architectures {archs!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    model_type = SUPPORTED_ARCHITECTURES[arch]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise CheckpointError("config.json: mlp_bias is not supported")
    dim, n_heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        head_dim = _int(cfg, "head_dim")
    attention_bias = bool(cfg.get("attention_bias", False))
    max_seq_len = _int(cfg, "max_position_embeddings")
    window = _window(cfg, model_type)
    if window is not None:
        max_seq_len = min(max_seq_len, window)
    theta, scaling = _rope(cfg)
    stored = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    checkpoint_dtype = _DTYPE_NAMES.get(str(stored).removeprefix("torch."))
    if checkpoint_dtype is None:
        raise CheckpointError(f"config.json: dtype {stored!r} is not supported; supported: float32, float16, bfloat16")
    try:
        model = ModelConfig(
            vocab_size=_int(cfg, "vocab_size"),
            dim=dim,
            n_layers=_int(cfg, "num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=_int(cfg, "num_key_value_heads", n_heads),
            ffn_dim=_int(cfg, "intermediate_size"),
            max_seq_len=max_seq_len,
            rope_theta=theta,
            norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            dtype=checkpoint_dtype,
            head_dim_override=head_dim if head_dim is not None and head_dim != dim // n_heads else None,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "qwen3") and attention_bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
        )
    except ValueError as exc:
        raise CheckpointError(f"config.json: {exc}") from None
    return CheckpointConfig(
        model=model,
        architecture=arch,
        model_type=model_type,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        checkpoint_dtype=checkpoint_dtype,
        bos_token_id=(token_ids(cfg.get("bos_token_id"), "config.json: bos_token_id") or (None,))[0],
        eos_token_ids=eos_override or token_ids(cfg.get("eos_token_id"), "config.json: eos_token_id"),
    )


def read_config_files(path: str | os.PathLike[str]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """A checkpoint directory's ``config.json`` and the EOS ids of its ``generation_config.json``
    (empty when it has none; they win over the config's). Raises ``CheckpointError``."""
    root = checkpoint_dir(path)
    eos: tuple[int, ...] = ()
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path, "generation_config.json")
        eos = token_ids(gen.get("eos_token_id"), "generation_config.json: eos_token_id")
    return read_json(root / "config.json", "config.json"), eos


def read_config(path: str | os.PathLike[str]) -> CheckpointConfig:
    """The checkpoint directory's config: ``config.json`` with the EOS ids of ``generation_config.json``
    when that file exists (they win). Raises ``CheckpointError``."""
    cfg, eos = read_config_files(path)
    return parse_config(cfg, eos_override=eos)


def serving_dtype(checkpoint_dtype: str, device: torch.device, override: str | None = None) -> str:
    """The dtype to run in: ``override`` when given; else on CUDA the checkpoint's dtype (fp32
    checkpoints stay fp32), and fp32 on CPU (half precision matmuls are slow there and inexact)."""
    if override is not None:
        name = _DTYPE_NAMES.get(override)
        if name is None:
            raise CheckpointError(f"dtype {override!r} is not supported; supported: float32, float16, bfloat16")
        return name
    return checkpoint_dtype if device.type == "cuda" else "float32"
