"""Batched varlen forward over the paged KV: many sequences, one model pass.

``forward_batch`` runs a batch of sequences of different lengths, start positions and block tables
through ``LlamaModel``: the token embeddings, every weight matmul (QKV, output projection, MLP) and
the KV write run once over all batch tokens; attention runs over K/V read back from the pages, as
``LlamaModel.forward`` does, so a cached prefix, an earlier chunk and a freshly written chunk are
indistinguishable. Decode items (one new token) are attended together in one padded SDPA call (the
padding points at the sequence's own first slot and is masked, so poisoned free pages are never
read); prefill chunks are attended one SDPA call per sequence (causal within the chunk).

Built only from the model's public pieces (``tok_emb``, ``layers``, ``_qkv``, ``_attn_out``, ``_mlp``, ``_rms``,
``norm``, ``lm_head``, ``cos``/``sin``), so it follows whatever those pieces compute. Each item's logits
equal what ``model.forward`` returns for it alone, within fp32 rounding (the batched matmuls sum in
another order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.pages import KVPages


@dataclass(frozen=True)
class BatchItem:
    """Compute ``tokens`` (new ids) at positions ``start..start+len(tokens)-1`` of the sequence whose
    blocks are ``block_table``; positions below ``start`` must already be in the pages."""

    tokens: list[int]
    start: int
    block_table: list[int]


def _check(model, pages: KVPages, items: list[BatchItem]) -> None:
    cfg, bs = model.config, pages.layout.block_size
    if not items:
        raise ValueError("a batch needs at least one item")
    if pages.layout != cfg.kv_layout(bs):
        raise ValueError(f"pages layout {pages.layout} does not match the model's {cfg.kv_layout(bs)}")
    if pages.device != model.device:
        raise ValueError(f"pages are on {pages.device}, model on {model.device}")
    for it in items:
        if not it.tokens:
            raise InvalidPrompt("every batch item needs at least one token")
        if isinstance(it.start, bool) or not isinstance(it.start, int) or it.start < 0:
            raise ValueError(f"start must be a non-negative int, got {it.start!r}")
        total = it.start + len(it.tokens)
        if total > cfg.max_seq_len:
            raise PromptTooLong(f"{total} positions exceed max_seq_len {cfg.max_seq_len}")
        if min(it.tokens) < 0 or max(it.tokens) >= cfg.vocab_size:
            raise InvalidPrompt(f"token ids must lie in 0..{cfg.vocab_size - 1}")
        needed = -(-total // bs)
        if len(it.block_table) < needed:
            raise ValueError(f"block table of {len(it.block_table)} blocks cannot hold {total} positions")
        if min(it.block_table[:needed]) < 0 or max(it.block_table[:needed]) >= pages.num_blocks:
            raise ValueError(f"block table names blocks outside 0..{pages.num_blocks - 1}")


@torch.inference_mode()
def forward_batch(model, pages: KVPages, items: list[BatchItem]) -> torch.Tensor:
    """Logits ``[len(items), vocab]`` (fp32) of the last new token of each item, in item order.

    Writes every item's new K/V into ``pages`` through its block table. Raises ``InvalidPrompt`` (bad
    tokens), ``PromptTooLong`` (past ``max_seq_len``) and ``ValueError`` (pages of another layout or
    device, a block table too short or naming blocks outside the pages); nothing is written then.
    Two items must not write the same slot (distinct sequences own distinct fresh blocks).
    """
    _check(model, pages, items)
    dev, bs = model.device, pages.layout.block_size
    lens = [len(it.tokens) for it in items]
    flat_tokens, flat_pos, flat_slots = [], [], []
    for it in items:
        flat_tokens += it.tokens
        for p in range(it.start, it.start + len(it.tokens)):
            flat_pos.append(p)
            flat_slots.append(it.block_table[p // bs] * bs + p % bs)
    tokens = torch.tensor(flat_tokens, dtype=torch.long).to(dev)
    pos = torch.tensor(flat_pos, dtype=torch.long).to(dev)
    slots = torch.tensor(flat_slots, dtype=torch.long).to(dev)
    cos, sin = model.cos[pos], model.sin[pos]

    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    decode = [i for i, n in enumerate(lens) if n == 1]
    chunks = [i for i, n in enumerate(lens) if n > 1]
    dec = _decode_index(items, decode, bs, len(model.layers), dev) if decode else None
    kv_rows = pages.kv.view(-1, pages.layout.num_kv_heads * pages.layout.head_dim)  # one row per token slot
    chunk_meta = []
    for i in chunks:
        it = items[i]
        total = it.start + lens[i]
        table = torch.tensor(it.block_table, dtype=torch.long).to(dev)
        mask = None
        if it.start:
            q_pos = torch.arange(it.start, total, device=dev)
            mask = torch.arange(total, device=dev)[None, :] <= q_pos[:, None]
        chunk_meta.append((i, table, total, mask))

    x = model.tok_emb[tokens]
    for li, layer in enumerate(model.layers):
        q, k, v = model._qkv(layer, x, cos, sin)
        pages.write_layer(li, slots, k, v)
        out = torch.empty_like(q)
        if dec is not None:
            rows, base, valid = dec
            k_rows = base.flatten() + li * 2 * bs  # row of (block, layer li, K, offset); V: bs rows on
            kd = kv_rows.index_select(0, k_rows).view(*base.shape, *k.shape[1:])  # [B, L, kv_heads, hd]
            vd = kv_rows.index_select(0, k_rows + bs).view(*base.shape, *k.shape[1:])
            attn = F.scaled_dot_product_attention(
                q[rows][:, :, None, :],  # [B, heads, 1, hd]
                kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=valid, enable_gqa=True,
            )
            out[rows] = attn[:, :, 0, :]
        for i, table, total, mask in chunk_meta:
            a, b = offsets[i], offsets[i + 1]
            k_all, v_all = pages.gather_layer(li, table, total)
            attn = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )
            out[a:b] = attn[0].transpose(0, 1)
        x = x + model._attn_out(layer, out.reshape(x.shape[0], -1))
        x = x + model._mlp(layer, x)
    last = torch.tensor([o - 1 for o in offsets[1:]], dtype=torch.long).to(dev)
    return F.linear(model._rms(x[last], model.norm), model.lm_head).float()


def _decode_index(items: list[BatchItem], decode: list[int], bs: int, layers: int, dev):
    """Row of each decode item in the flat batch; per item the page-tensor row (layer 0, K) of every
    position ``0..start``, padded to the longest with the item's own position 0; the validity mask.

    Rows follow the page layout ``[block, layer, k|v, offset]``: ``((block * layers + layer) * 2 +
    kv) * block_size + offset``."""
    width = max(items[i].start + 1 for i in decode)
    flat_row, row = {}, 0
    for i, it in enumerate(items):
        flat_row[i] = row
        row += len(it.tokens)
    rows, base, valid = [], [], []
    for i in decode:
        it = items[i]
        n = it.start + 1
        slots = [(it.block_table[p // bs] * layers * 2) * bs + p % bs for p in range(n)]
        base.append(slots + [slots[0]] * (width - n))
        valid.append([True] * n + [False] * (width - n))
        rows.append(flat_row[i])
    if all(all(v) for v in valid):
        mask = None  # no padding: every query sees all its positions (the unmasked kernel)
    else:
        mask = torch.tensor(valid, dtype=torch.bool).to(dev)[:, None, None, :]  # [B, 1, 1, L]
    return torch.tensor(rows, dtype=torch.long).to(dev), torch.tensor(base, dtype=torch.long).to(dev), mask
