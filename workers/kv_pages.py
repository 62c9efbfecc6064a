"""vLLM's KV pages as Strata blocks: gather the pages of some vLLM blocks into Strata's block layout,
and scatter Strata blocks back into vLLM's pages.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``) whose logical shape
is ``[num_blocks, H, N, C]`` (kv heads, tokens per block, content). On its CPU backend (``CPU_ATTN``)
the content of a block's head is K then V (``[2, N, D]`` in memory: it views ``[N, 2D]`` as
``[2N, D]`` and splits it), so a vLLM page converts exactly to Strata's canonical block
``[layers, 2, N, H, D]`` (``cachecore.layout.KVLayout.page_shape``): the same bytes the reference
engine stores, so the KV API means the same thing on both engines. On other backends the page's
bytes are kept as vLLM lays them out (``native``), and the layout the namespace binds says so: blocks
of two layouts never share a key.
"""

from __future__ import annotations

import re

import torch

from cachecore.layout import KVLayout

CANONICAL_BACKENDS = frozenset({"CPU_ATTN"})


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
            out = torch.stack([p.reshape(n, h, 2, bs, d).permute(0, 2, 3, 1, 4) for p in parts], dim=1)
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
                src = src.permute(0, 3, 1, 2, 4).contiguous().reshape(n, heads, tokens, content)
            page.index_copy_(0, ids, src.to(page.dtype))
