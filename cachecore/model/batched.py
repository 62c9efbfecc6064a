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

The step's index tensors (positions, KV slots, the decode rows' page rows and mask) are built once
per call with tensor arithmetic over a ``[items, blocks]`` table: Python touches each item and each
block, never each token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.model.llama import gather_kv
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
    idx = _StepIndex(items, bs, len(model.layers))
    tokens, pos, slots = idx.tokens.to(dev), idx.pos.to(dev), idx.slots.to(dev)
    cos, sin = model.cos[pos], model.sin[pos]
    dec = None
    if idx.decode:
        rows = idx.decode_rows.to(dev)
        dec = (None if idx.all_decode else rows, idx.decode_base.to(dev),
               None if idx.decode_mask is None else idx.decode_mask.to(dev))
    kv_rows = pages.kv.view(-1, pages.layout.num_kv_heads * pages.layout.head_dim)  # one row per token slot
    chunk_meta = []
    for i in idx.chunks:
        it = items[i]
        total = it.start + len(it.tokens)
        table = idx.table[i, : -(-total // bs)].to(dev)
        mask = None
        if it.start:
            q_pos = torch.arange(it.start, total, device=dev)
            mask = torch.arange(total, device=dev)[None, :] <= q_pos[:, None]
        chunk_meta.append((idx.offsets[i], idx.offsets[i + 1], table, total, mask))

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
            qd = q if rows is None else q.index_select(0, rows)
            attn = F.scaled_dot_product_attention(
                qd[:, :, None, :],  # [B, heads, 1, hd]
                kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=valid, enable_gqa=True,
            )
            if rows is None:
                out = attn[:, :, 0, :]
            else:
                out[rows] = attn[:, :, 0, :]
        for a, b, table, total, mask in chunk_meta:
            k_all, v_all = gather_kv(pages, li, table, total)
            attn = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )
            out[a:b] = attn[0].transpose(0, 1)
        x = x + model._attn_out(layer, out.reshape(x.shape[0], -1))
        x = x + model._mlp(layer, x)
    last = idx.last.to(dev)
    return F.linear(model._rms(x.index_select(0, last), model.norm), model.lm_head).float()


class _StepIndex:
    """The index tensors of one batch (CPU, long), built from per-item and per-block lists only.

    ``tokens``, ``pos``, ``slots``: each new token's id, position and KV slot, items concatenated;
    ``offsets``: where each item's tokens start in that flat batch; ``last``: each item's last row;
    ``table``: ``[items, blocks]`` block tables (short ones padded with their first block);
    ``decode`` / ``chunks``: indices of one-token items and of longer ones. For the decode items:
    ``decode_rows`` (their rows in the flat batch), ``decode_base`` (per item the page-tensor row of
    layer 0, K, of every position ``0..start``, padded to the longest with the item's own position 0,
    so padding never reads a block it does not hold) and ``decode_mask`` (``[B, 1, 1, L]`` validity,
    None when nothing is padded). Page rows follow the layout ``[block, layer, k|v, offset]``:
    ``((block * layers + layer) * 2 + kv) * block_size + offset``."""

    def __init__(self, items: list[BatchItem], bs: int, layers: int) -> None:
        lens = [len(it.tokens) for it in items]
        starts = [it.start for it in items]
        self.offsets = [0, *itertools.accumulate(lens)]
        self.decode = [i for i, n in enumerate(lens) if n == 1]
        self.chunks = [i for i, n in enumerate(lens) if n > 1]
        self.all_decode = not self.chunks
        width = max(-(-(s + n) // bs) for s, n in zip(starts, lens, strict=True))
        self.table = torch.tensor([it.block_table[:width] + [it.block_table[0]] * (width - len(it.block_table[:width]))
                                   for it in items], dtype=torch.long)
        self.tokens = torch.tensor(list(itertools.chain.from_iterable(it.tokens for it in items)), dtype=torch.long)
        lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)
        item_of = torch.repeat_interleave(torch.arange(len(items)), lens_t)  # the item of each flat token
        self.pos = torch.arange(len(self.tokens)) - torch.tensor(self.offsets[:-1])[item_of] + starts_t[item_of]
        self.slots = self.table[item_of, self.pos // bs] * bs + self.pos % bs
        self.last = torch.tensor(self.offsets[1:]) - 1
        self.decode_mask = None
        if self.decode:
            dec = torch.tensor(self.decode)
            self.decode_rows = torch.tensor([self.offsets[i] for i in self.decode])
            n = starts_t[dec] + 1  # positions each decode item attends to
            p = torch.arange(max(starts[i] for i in self.decode) + 1)[None, :]
            valid = p < n[:, None]
            p = torch.where(valid, p, 0)
            self.decode_base = self.table[dec[:, None], p // bs] * (layers * 2 * bs) + p % bs
            if not bool(valid.all()):
                self.decode_mask = valid[:, None, None, :]  # [B, 1, 1, L]
