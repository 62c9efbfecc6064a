"""Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over paged KV.

The config switches cover the Hugging Face Llama family: q/k/v (and output) biases (Qwen2, Llama's
``attention_bias``), RMSNorm of each q/k head before RoPE (Qwen3), an explicit head size, RoPE
scaling (Llama 3) and tied or untied embeddings.

``forward`` is the serving path: it writes the new positions' K/V into the page tensor through the
block table and attends over K/V *read back from the pages*, so a request whose prefix KV came from
the cache computes exactly what a cold request computes. ``forward_dense`` is an independent,
page-free reference used by tests to prove that.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.layout import torch_dtype
from cachecore.model.config import ModelConfig, RopeScaling
from cachecore.model.linear import Linear
from cachecore.model.weights import validate_weights
from cachecore.pages import KVPages


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies of one head (``head_dim / 2``, fp32 on CPU), scaled when configured.
    Computed as transformers computes them (fp32), so the angles match it bit for bit."""
    hd = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    return rope_scaled(config.rope_scaling, freqs) if config.rope_scaling is not None else freqs


def rope_scaled(scaling: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    """The inverse frequencies scaled by ``scaling`` (the formulas, and the fp32 arithmetic, of
    transformers' ``rope_init_fn``s, so positions rotate by exactly the same angles)."""
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class _Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: Linear  # rows: wq, then wk, then wv (fused: one matmul); q, k, v biases when config.qkv_bias
    wo: Linear  # output projection (its bias when config.o_bias)
    ffn_norm: torch.Tensor
    w13: Linear  # rows: w1 (gate), then w3 (up)
    w2: Linear
    q_norm: torch.Tensor | None = None  # per-head RMSNorm weights [head_dim] (config.qk_norm)
    k_norm: torch.Tensor | None = None


class LlamaModel:
    """Decoder with ``config`` and ``weights`` (names as in ``weights.weight_shapes``) on ``device``.

    Weights are validated (``ValueError``), cast to ``config.dtype`` and moved to ``device`` once.
    Without ``output.weight`` the lm head is tied to the embeddings. The weight matmuls are
    ``Linear``s (on a CPU, oneDNN over weights reordered here). Stateless between calls: all sequence
    state lives in the pages and the caller's block table.
    """

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str
    ) -> None:
        validate_weights(weights, config)
        self.config = config
        dtype = torch_dtype(config.dtype)
        w = {k: v.to(device=torch.device(device), dtype=dtype) for k, v in weights.items()}
        self.tok_emb = w["tok_embeddings.weight"]
        self.device = self.tok_emb.device
        self.tied = "output.weight" not in w
        # tied: the embedding itself, plain (a reordered copy would hold the vocabulary twice)
        self.head = Linear(self.tok_emb, pack=False) if self.tied else Linear(w["output.weight"])
        self.norm = w["norm.weight"]
        self.layers: list[_Layer] = []
        for i in range(config.n_layers):
            p = f"layers.{i}."
            a = p + "attention."
            qkv = ("wq", "wk", "wv")
            self.layers.append(
                _Layer(
                    attn_norm=w[p + "attention_norm.weight"],
                    wqkv=Linear(torch.cat([w[a + f"{n}.weight"] for n in qkv]),
                                torch.cat([w[a + f"{n}.bias"] for n in qkv]) if config.qkv_bias else None),
                    wo=Linear(w[a + "wo.weight"], w[a + "wo.bias"] if config.o_bias else None),
                    ffn_norm=w[p + "ffn_norm.weight"],
                    w13=Linear(torch.cat([w[p + "feed_forward.w1.weight"], w[p + "feed_forward.w3.weight"]])),
                    w2=Linear(w[p + "feed_forward.w2.weight"]),
                    q_norm=w[a + "q_norm.weight"] if config.qk_norm else None,
                    k_norm=w[a + "k_norm.weight"] if config.qk_norm else None,
                )
            )
        # fp32 angles computed as transformers computes them (RoPE scaling included).
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), rope_inv_freq(config))
        self.cos = angles.cos().to(device=self.device)  # [max_seq_len, hd/2]
        self.sin = angles.sin().to(device=self.device)

    # ---- serving path ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start_pos: int, block_table: torch.Tensor, pages: KVPages
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` (fp32) for ``tokens`` at positions ``start_pos..start_pos+n-1``.

        Writes those positions' K/V into ``pages`` at slot ``block_table[p // bs] * bs + p % bs`` and
        attends over positions ``0..start_pos+n-1`` gathered from the pages (positions before
        ``start_pos`` must already be there: a cached prefix or an earlier chunk). Causal within the
        chunk. Raises ``InvalidPrompt`` (bad tokens), ``PromptTooLong`` (past ``max_seq_len``),
        ``ValueError`` (pages of another layout or device, block table too short or naming blocks
        outside the pages). Any block size works: it is read from ``pages.layout``.
        """
        n = self._check_tokens(tokens, start_pos)
        cfg, bs = self.config, pages.layout.block_size
        total = start_pos + n
        if pages.layout != cfg.kv_layout(bs):
            raise ValueError(f"pages layout {pages.layout} does not match the model's {cfg.kv_layout(bs)}")
        if pages.device != self.device:
            raise ValueError(f"pages are on {pages.device}, model on {self.device}")
        needed = -(-total // bs)
        if block_table.dim() != 1 or block_table.shape[0] < needed:
            raise ValueError(f"block table of shape {tuple(block_table.shape)} cannot hold {total} positions")
        if int(block_table[:needed].min()) < 0 or int(block_table[:needed].max()) >= pages.num_blocks:
            raise ValueError(f"block table names blocks outside 0..{pages.num_blocks - 1}")
        tokens, block_table = tokens.to(self.device), block_table.to(self.device, torch.int64)
        pos = torch.arange(start_pos, total, device=self.device)
        slots = block_table[pos // bs] * bs + pos % bs
        rope, rows = self.rope_at(slice(start_pos, total)), pages.slot_rows(slots)
        if start_pos == 0 or n == 1:
            mask = None  # square causal (is_causal) or one query that sees everything
        else:
            mask = torch.arange(total, device=self.device)[None, :] <= pos[:, None]
        x = self.tok_emb[tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            pages.write_layer(i, slots, k, v, rows=rows)
            # from position 0 the pages hold exactly k and v (same dtype): attend over them as they are
            k_all, v_all = (k, v) if start_pos == 0 else gather_kv(pages, i, block_table, total)
            if n == 1:
                attn = decode_attention(q, k_all[None], v_all[None])
            else:
                # 4-D [1, heads, seq, hd]: the fused CPU kernel only takes batched 4-D input (3-D falls
                # back to the math path, ~5x slower).
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    k_all.transpose(0, 1)[None],
                    v_all.transpose(0, 1)[None],
                    attn_mask=mask,
                    is_causal=start_pos == 0,
                    enable_gqa=True,
                )[0].transpose(0, 1)
            x = x + self._attn_out(layer, attn.reshape(n, -1))
            x = x + self._mlp(layer, x)
        return self.logits(x)

    # ---- reference path ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Reference logits ``[n, vocab]`` (fp32) for ``tokens`` at positions ``0..n-1``, no pages.

        Plain causal attention written out (scores, -inf mask, softmax), GQA by repeating KV heads.
        """
        n = self._check_tokens(tokens, 0)
        cfg, hd = self.config, self.config.head_dim
        rope = self.rope_at(slice(0, n))
        future = torch.ones(n, n, dtype=torch.bool, device=self.device).triu(1)
        x = self.tok_emb[tokens.to(self.device)]
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, rope)
            group = cfg.n_heads // cfg.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(hd)
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            attn = torch.einsum("hqk,khd->qhd", probs, v.float()).to(x.dtype)
            x = x + self._attn_out(layer, attn.reshape(n, -1))
            x = x + self._mlp(layer, x)
        return self.logits(x)

    # ---- pieces ------------------------------------------------------------------------------------

    @property
    def lm_head(self) -> torch.Tensor:
        """The output projection's plain weight ``[vocab, dim]`` (tied: the embedding itself)."""
        return self.head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of hidden states ``x`` ``[n, dim]``: final norm, then the output projection."""
        return self.head(self._rms(x, self.norm)).float()

    def rope_at(self, pos: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE factors ``(cos, sin)`` of positions ``pos`` (a slice, or an index tensor on the model's
        device), each ``[n, 1, hd]``: the angles' cosines over both halves of a head, their sines negated
        over the first half, so that ``_rope`` turns a head with two products and one sum. Built once per
        forward, used by every layer."""
        cos, sin = self.cos[pos], self.sin[pos]
        return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[n, heads, hd]``, k and v ``[n, kv_heads, hd]`` of ``x`` ``[n, dim]`` at the positions whose
        factors are ``rope`` (``rope_at``): projections (with biases when configured), q/k head norms when
        configured, then RoPE on q and k."""
        cfg, hd = self.config, self.config.head_dim
        qkv = layer.wqkv(self._rms(x, layer.attn_norm))
        n, heads, kv_heads = x.shape[0], cfg.n_heads, cfg.n_kv_heads
        v = qkv[:, (heads + kv_heads) * hd :].view(n, kv_heads, hd)
        if layer.q_norm is None:
            # q's and k's heads lie side by side in qkv: one rotation for both (per-op cost dominates a decode)
            qk = _rope(qkv[:, : (heads + kv_heads) * hd].view(n, heads + kv_heads, hd), *rope)
            return qk[:, :heads], qk[:, heads:], v
        q = qkv[:, : heads * hd].view(n, heads, hd)
        k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(n, kv_heads, hd)
        return _rope(self._rms(q, layer.q_norm), *rope), _rope(self._rms(k, layer.k_norm), *rope), v

    def _attn_out(self, layer: _Layer, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of the attention ``[n, heads * hd]`` (with its bias when configured)."""
        return layer.wo(attn)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.w13(self._rms(x, layer.ffn_norm)).chunk(2, dim=-1)
        return layer.w2(F.silu(gate) * up)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        return xf.to(x.dtype) * weight

    def _check_tokens(self, tokens: torch.Tensor, start_pos: int) -> int:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0:
            raise InvalidPrompt("tokens must be a non-empty 1-D tensor")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise InvalidPrompt(f"tokens must be integer ids, got {tokens.dtype}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise InvalidPrompt(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
        n = tokens.shape[0]
        if start_pos + n > self.config.max_seq_len:
            raise PromptTooLong(f"{start_pos + n} positions exceed max_seq_len {self.config.max_seq_len}")
        return n


def gather_kv(pages: KVPages, layer: int, block_table: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[total, kv_heads, hd]`` of ``layer`` for positions ``0..total-1`` read from ``pages``: what
    ``KVPages.gather_layer`` returns, gathered with ``index_select`` (one block-row copy per block; the
    advanced-indexing gather is ~4x slower on CPU, a tenth of a decode step). ``block_table`` is
    already validated and on the pages' device."""
    lay = pages.layout
    ids = block_table[: -(-total // lay.block_size)]
    k = torch.index_select(pages.kv[:, layer, 0], 0, ids).view(-1, lay.num_kv_heads, lay.head_dim)[:total]
    v = torch.index_select(pages.kv[:, layer, 1], 0, ids).view(-1, lay.num_kv_heads, lay.head_dim)[:total]
    return k, v


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention ``[B, heads, hd]`` of one query per item, ``q`` ``[B, heads, hd]``, over ``k``/``v``
    ``[B, L, kv_heads, hd]`` (``valid``: ``[B, 1, 1, L]`` bool, or None when every position counts).

    The query heads that share a KV head are attended as that head's rows of queries
    (``[B, kv_heads, group, hd]``, query head ``h`` on KV head ``h // group`` as ``enable_gqa`` pairs them):
    the fused kernel then reads each KV head once for its whole group instead of once per query head,
    which on CPU took a decode layer's attention at 2,048 positions from ~290 to ~160 us. The same
    values within fp32 rounding (the kernel blocks the sums another way)."""
    b, heads, hd = q.shape
    kvh = k.shape[2]
    out = F.scaled_dot_product_attention(
        q.reshape(b, kvh, heads // kvh, hd), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid
    )
    return out.reshape(b, heads, hd)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves ``x1``, ``x2`` of each head of ``x`` ``[n, heads, hd]`` by the factors of
    ``LlamaModel.rope_at``, in fp32: ``x1 * cos - x2 * sin`` then ``x2 * cos + x1 * sin`` (written as
    ``x * cos + halves_swapped(x) * sin``, bit for bit the same values, as transformers computes them)."""
    xf = x.float()
    # in place where the result is fresh: a prefill's q/k are megabytes, and each temporary costs a pass
    return (xf * cos).add_(xf.roll(x.shape[-1] // 2, dims=-1).mul_(sin)).to(x.dtype)
