"""PEFT LoRA adapter directories built without peft, and the merged model they amount to.

``build_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's names:
``base_model.model.<module>.lora_A.weight`` is ``r x in``, ``lora_B.weight`` ``out x r``) for the
attention projections of a Hugging Face model; ``merged`` is a copy of that model with each adapted
weight ``W + B @ A * alpha / r``: what the adapter computes, for a reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PREFIX = "base_model.model."


def build_adapter(path: Path, hf, *, seed: int, rank: int = 8, alpha: int = 16, scale: float = 0.1,
                  targets: tuple[str, ...] = ("q_proj", "v_proj"), dtype=torch.float32,
                  config: dict | None = None) -> dict[str, torch.Tensor]:
    """Write an adapter for ``hf`` under ``path``; returns its tensors."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, torch.nn.Linear):
            out_features, in_features = module.weight.shape
            tensors[f"{PREFIX}{name}.lora_A.weight"] = (torch.randn(rank, in_features, generator=g) * scale).to(dtype)
            tensors[f"{PREFIX}{name}.lora_B.weight"] = (torch.randn(out_features, rank, generator=g) * scale).to(dtype)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "task_type": "CAUSAL_LM", "lora_dropout": 0.0, **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


def merged(hf, tensors: dict[str, torch.Tensor], *, rank: int = 8, alpha: int = 16):
    """A copy of ``hf`` with the adapter's deltas merged into its weights."""
    model = copy.deepcopy(hf)
    state = model.state_dict()
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name[len(PREFIX):-len(".lora_A.weight")]
            b = tensors[name.replace("lora_A", "lora_B")]
            state[module + ".weight"] = state[module + ".weight"] + (b.float() @ a.float()) * (alpha / rank)
    model.load_state_dict(state)
    return model.eval()
