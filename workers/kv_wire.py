"""KV tensors to and from ``workers.protocol.KVWire`` (shape, dtype, raw bytes): on the replica's side
of the KV API, so the web tier moves KV as plain bytes and never imports torch. Also the format the
vLLM replica uses to move KV to its tier service (``workers.vllm_kv_api``, ``workers.kv_tiers``)."""

from __future__ import annotations

import numpy as np
import torch

from workers.protocol import KVRetrieved, KVWire


def to_wire(kv: torch.Tensor) -> KVWire:
    """``kv``'s raw bytes in its own dtype. Through a uint8 view rather than numpy, which has no
    bfloat16."""
    return {"shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch."),
            "data": kv.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()}


def from_wire(d: KVWire) -> torch.Tensor:
    """The tensor ``d`` describes (a copy: writable, owning its memory)."""
    dtype = getattr(torch, d["dtype"])
    raw = torch.from_numpy(np.frombuffer(d["data"], dtype=np.uint8).copy())
    return raw.view(dtype).reshape(d["shape"])


def retrieved_wire(kv: torch.Tensor, mask: torch.Tensor, origin: str | None) -> KVRetrieved:
    """A ``kv_retrieve`` result ``(kv, mask, origin)`` as plain data (``workers.protocol.KVRetrieved``)."""
    return {"hit_tokens": int(mask.sum()), "origin": origin, "kv": to_wire(kv)}
