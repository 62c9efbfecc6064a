"""vLLM's KV pages as Strata blocks: gather the pages of some vLLM blocks into Strata's block layout,
and scatter Strata blocks back into vLLM's pages.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``) whose logical shape
is ``[num_blocks, H, N, C]`` (kv heads, tokens per block, content). What a page's bytes mean depends
on the attention kernel. On vLLM's CPU backend with its ``vec`` kernel (x86, float32/bfloat16 without
AMX, block size a multiple of 32) each head's content is K transposed (``[D, N]``) then V
(``[N, D]``) — checked against transformers' own K and V in ``tests/vllm/test_vllm_tiers.py`` — so a
page converts exactly to Strata's canonical block ``[layers, 2, N, H, D]``
(``cachecore.layout.KVLayout.page_shape``), the reference engine's, and the KV API means the same
thing on both engines (``pages="canonical"``). For any other kernel the bytes are kept as vLLM lays
them out (``pages="native-<kernel>"``); the namespace binds that descriptor, so blocks of two layouts
never share a key.
"""

from __future__ import annotations

import re

import torch

from cachecore.layout import KVLayout

CANONICAL = "canonical"


def page_format(device: str, dtype: str, block_size: int, head_dim: int) -> str:
    """``"canonical"`` where the pages convert exactly (module doc), else ``"native-<kernel>"``."""
    if device != "cpu":
        return f"native-{device}"
    try:
        import torch as _torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(getattr(_torch, dtype), block_size, head_dim)
    except Exception:  # another vLLM: its kernel's layout is not known here
        return "native-cpu"
    return CANONICAL if isa == "vec" else f"native-cpu-{isa}"


def _layer_order(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


class PageCodec:
    """Copies between vLLM's per-layer caches and ``[n, *layout.page_shape]`` host tensors."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layout: KVLayout, *, native: bool) -> None:
        self.layers = [kv_caches[k] for k in sorted(kv_caches, key=_layer_order)]
        if len(self.layers) != layout.num_layers:
            raise ValueError(f"vLLM registered {len(self.layers)} KV layers; the checkpoint has {layout.num_layers}")
        first = self.layers[0]
        self.num_blocks, heads, tokens, content = first.shape
        if (heads, tokens) != (layout.num_kv_heads, layout.block_size) or content * heads * tokens * len(self.layers) \
                != 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim:
            raise ValueError(f"vLLM's KV pages {tuple(first.shape)} do not match the layout {layout.canonical()}")
        self.layout = layout
        self.native = native
        self.device = first.device

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The pages of ``block_ids`` as ``[n, *page_shape]`` on the host (a copy)."""
        lay = self.layout
        n = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [kv.index_select(0, ids) for kv in self.layers]  # [n, H, N, C] each
        if self.native:
            out = torch.stack(parts, dim=1)
        else:
            h, bs, d = lay.num_kv_heads, lay.block_size, lay.head_dim
            blocks = []
            for p in parts:
                flat = p.reshape(n, h, 2, bs * d)
                k = flat[:, :, 0].reshape(n, h, d, bs).transpose(2, 3)  # [n, H, N, D]
                v = flat[:, :, 1].reshape(n, h, bs, d)
                blocks.append(torch.stack((k, v), dim=1).permute(0, 1, 3, 2, 4))  # [n, 2, N, H, D]
            out = torch.stack(blocks, dim=1)
        return out.reshape(n, *lay.page_shape).to("cpu", copy=out.device.type == "cpu").contiguous()

    def scatter(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write ``kv`` (``[n, *page_shape]``) into the pages of ``block_ids``."""
        n = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = kv[:n].to(self.device)
        for layer, page in enumerate(self.layers):
            _, heads, tokens, content = page.shape
            src = kv[:, layer]  # [n, 2, N, H, D]
            if self.native:
                src = src.reshape(n, heads, tokens, content)
            else:
                k = src[:, 0].permute(0, 2, 3, 1)  # [n, H, D, N]
                v = src[:, 1].permute(0, 2, 1, 3)  # [n, H, N, D]
                src = torch.cat((k.reshape(n, heads, -1), v.reshape(n, heads, -1)), dim=2)
                src = src.reshape(n, heads, tokens, content)
            page.index_copy_(0, ids, src.to(page.dtype))
