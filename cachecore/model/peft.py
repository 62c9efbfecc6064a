"""A PEFT LoRA adapter directory read without loading it (plain Python, no torch): its config, its
tensors' names, shapes and dtypes from the safetensors header, its digest (``digest``: what the control
plane records and a vLLM replica checks before it serves the files), and the check against the base
checkpoint it is registered on (``inspect_adapter``, by ``controlplane.adapters.services``).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose tensors are
named as PEFT saves them: ``base_model.model.<module>.lora_A.weight`` (``r x in_features``) and
``...lora_B.weight`` (``out_features x r``) for each adapted linear layer ``<module>`` of the base
model (whose weight is ``<module>.weight``, ``out_features x in_features``). ``AdapterError`` says
what is wrong, in words an operator can act on.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FILES = (CONFIG, WEIGHTS)
PREFIX = "base_model.model."
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
DIGEST_FORMAT = b"strata-lora-v1"
# config.json keys of a mixture of experts: served without LoRA (vLLM's LoRA of fused experts needs
# kernels its CPU build lacks), so adapters are refused on them
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def is_moe(config: dict) -> bool:
    return any(config.get(k) for k in MOE_KEYS)


class AdapterError(ValueError):
    """The directory is not a LoRA adapter this base model can serve (the message says why)."""


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    digest: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    modules: tuple[str, ...]  # the adapted layers, e.g. "model.layers.0.self_attn.q_proj"


def confine(path: str, root: Path | None) -> Path:
    """``path`` resolved; inside ``root`` (when set) with both files, none a link out of it."""
    resolved = Path(str(path)).expanduser().resolve()
    if root is not None and not resolved.is_relative_to(Path(root).resolve()):
        raise AdapterError(f"path must be inside {root}")
    if not resolved.is_dir():
        raise AdapterError(f"adapter path {str(path)!r} is not a directory")
    for name in FILES:
        file = resolved / name
        if not file.is_file():
            raise AdapterError(f"adapter path {str(path)!r} has no {name} (a PEFT LoRA adapter directory "
                               f"holds {CONFIG} and {WEIGHTS})")
        if root is not None and not file.resolve().is_relative_to(Path(root).resolve()):
            raise AdapterError(f"adapter file {name!r} resolves outside the weights root {str(root)!r} "
                               "(a symlink out of it); refused")
    return resolved


def digest(root: Path) -> str:
    """sha256 over a manifest of the adapter's two files (their own sha256)."""
    h = hashlib.sha256(DIGEST_FORMAT)
    for name in FILES:
        file_hash = hashlib.sha256()
        with (root / name).open("rb") as fh:
            while chunk := fh.read(1 << 20):
                file_hash.update(chunk)
        h.update(b"\0" + name.encode() + b"\0" + file_hash.digest())
    return h.hexdigest()


def _config(root: Path) -> dict:
    try:
        cfg = json.loads((root / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG} must be a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{CONFIG}: modules_to_save is not supported (only LoRA deltas of linear layers)")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG}: bias {cfg.get('bias')!r} is not supported (use \"none\")")
    if cfg.get("use_dora") or cfg.get("use_rslora"):
        raise AdapterError(f"{CONFIG}: DoRA and rsLoRA adapters are not supported")
    return cfg


def _tensors(root: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        with safe_open(root / WEIGHTS, framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{WEIGHTS} is not a readable safetensors file: {exc}") from None


def base_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """The base checkpoint's tensor shapes by name (headers only)."""
    from cachecore.model.digests import weight_files

    shapes: dict[str, tuple[int, ...]] = {}
    for fname in weight_files(checkpoint):
        with safe_open(checkpoint / fname, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def inspect_adapter(path: str, *, base: dict[str, tuple[int, ...]], max_rank: int,
                    root: Path | None = None) -> AdapterInfo:
    """Check the adapter at ``path`` against the base model's tensor shapes ``base`` (``base_shapes``):
    every adapted module is a linear layer of the base (``<module>.weight`` exists, 2-D) named by the
    config's ``target_modules``; ``lora_A`` is ``r x in_features`` and ``lora_B`` ``out_features x r``
    of that layer; ``r`` is the config's and at most ``max_rank``; one floating dtype."""
    resolved = confine(path, root)
    cfg = _config(resolved)
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{CONFIG}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} exceeds the largest rank this platform serves ({max_rank})")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterError(f"{CONFIG}: lora_alpha must be a positive number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise AdapterError(f"{CONFIG}: target_modules must be a non-empty list of module names")
    tensors = _tensors(resolved)
    if not tensors:
        raise AdapterError(f"{WEIGHTS} holds no tensors")
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    dtypes = set()
    for name, (shape, dtype) in tensors.items():
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(f"tensor {name!r} is not a LoRA weight of a linear layer "
                               "(expected base_model.model.<module>.lora_A.weight / lora_B.weight)")
        parts.setdefault(m["module"], {})[m["part"]] = shape
        dtypes.add(dtype)
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise AdapterError(f"adapter tensors must share one dtype of {', '.join(DTYPES.values())}; "
                           f"found {', '.join(sorted(dtypes))}")
    for module, ab in sorted(parts.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in targets:
            raise AdapterError(f"module {module!r} is not in target_modules {targets}")
        weight = base.get(module + ".weight")
        if weight is None or len(weight) != 2:
            raise AdapterError(f"the base model has no linear layer {module!r}")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"module {module!r} needs both lora_A and lora_B")
        out_features, in_features = weight
        if ab["A"] != (rank, in_features):
            raise AdapterError(f"{module}.lora_A has shape {list(ab['A'])}; the base layer needs "
                               f"[{rank}, {in_features}] (r x in_features)")
        if ab["B"] != (out_features, rank):
            raise AdapterError(f"{module}.lora_B has shape {list(ab['B'])}; the base layer needs "
                               f"[{out_features}, {rank}] (out_features x r)")
    unused = sorted(set(targets) - {m.rsplit(".", 1)[-1] for m in parts})
    if unused:
        raise AdapterError(f"target_modules {unused} have no LoRA weights in {WEIGHTS}")
    return AdapterInfo(path=str(resolved), digest=digest(resolved), rank=rank, alpha=float(alpha),
                       target_modules=tuple(sorted(set(targets))), dtype=DTYPES[next(iter(dtypes))],
                       modules=tuple(sorted(parts)))
