"""KV pages: the one preallocated tensor that holds the KV bytes of every block on a device.

This module only holds bytes. Which block belongs to whom, ref counts, hashes and token ids live in
``block_pool.py``; callers hand in block ids (and block tables) they own.

The tensor is block-major, ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``, so the bytes
of one block are contiguous: tiers move whole blocks with one copy each.

Addressing: a token slot is ``block_id * block_size + offset``; a block table lists, in order, the
block ids that hold positions ``0, block_size, 2 * block_size, ...`` of one sequence.
"""

from __future__ import annotations

import torch

from cachecore.errors import InvalidKV
from cachecore.layout import KVLayout


class KVPages:
    """Device-resident page tensor for ``num_blocks`` blocks of ``layout``.

    Contents are uninitialised at start-up (zeros); no method here reads a block that the caller did
    not name, so poisoning a freed block (:meth:`poison`) proves nobody reads it afterwards.
    Not thread-safe: one writer at a time (the worker's engine loop).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        # Never an inference tensor (even if built under inference_mode): tiers write it in place
        # from ordinary code, which torch forbids on inference tensors.
        with torch.inference_mode(False):
            self.kv = torch.zeros(
                (num_blocks, *layout.page_shape), dtype=layout.torch_dtype, device=torch.device(device)
            )
        self.device = self.kv.device  # indexed form ("cuda:0"), comparable with tensor devices
        # Row view: one row = one token's K (or V) of one layer; row index of (block, layer, kv, off)
        # is ((block * layers + layer) * 2 + kv) * block_size + off.
        self._rows = self.kv.view(-1, layout.num_kv_heads * layout.head_dim)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ---- per-layer access (model runner) ---------------------------------------------------------

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of ``slots`` (``[n]`` long) for ``write_layer``'s ``rows``: ``[2n]``, their K's rows at
        layer 0, then their V's (a forward computes them once, not once per layer)."""
        lay, bs = self.layout, self.layout.block_size
        slots = slots.to(self.device)
        k_rows = (slots // bs) * (lay.num_layers * 2 * bs) + slots % bs
        return torch.cat((k_rows, k_rows + bs))

    def write_layer(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rows: torch.Tensor | None = None
    ) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) of ``layer`` at token ``slots`` (``[n]`` long);
        ``rows``, when given, must be ``slot_rows(slots)``.

        Slots must be distinct and below ``num_blocks * block_size`` (not re-checked here: hot path).
        """
        lay = self.layout
        n = slots.shape[0]
        if k.shape != (n, lay.num_kv_heads, lay.head_dim) or v.shape != k.shape:
            raise InvalidKV(f"k/v shape {tuple(k.shape)}/{tuple(v.shape)} does not match {n} slots")
        rows = (self.slot_rows(slots) if rows is None else rows) + layer * 2 * lay.block_size
        src = torch.cat((k.reshape(n, -1), v.reshape(n, -1))).to(self.kv.dtype)
        self._rows.index_copy_(0, rows, src)

    def gather_layer(
        self, layer: int, block_table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(k, v)`` of ``layer`` for positions ``0..length-1`` of the sequence whose blocks are
        ``block_table`` (``[nb]`` long), each ``[length, kv_heads, head_dim]`` (fresh tensors).

        Reads only the first ``ceil(length / block_size)`` blocks of the table, and of the last one only
        the positions below ``length``. Raises ``ValueError`` if the table is too short.
        """
        lay = self.layout
        needed = -(-length // lay.block_size)
        if length <= 0 or block_table.shape[0] < needed:
            raise ValueError(f"block table of {block_table.shape[0]} blocks cannot hold {length} positions")
        ids = block_table[:needed].to(self.device)
        k = self.kv[ids, layer, 0].view(-1, lay.num_kv_heads, lay.head_dim)[:length]
        v = self.kv[ids, layer, 1].view(-1, lay.num_kv_heads, lay.head_dim)[:length]
        return k, v

    # ---- whole-block access (tiers, KV API) --------------------------------------------------------

    def read_blocks(self, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy blocks ``block_ids`` out as ``[n, *page_shape]`` (row i = block ``block_ids[i]``).

        ``out`` (optional, same shape/dtype/device as the result) receives the copy instead of a fresh
        tensor, which spares a large allocation per call (tiers keep a staging buffer).
        """
        ids = self._check_ids(block_ids)
        if out is None:
            return self.kv.index_select(0, ids)
        self._check_kv(out, ids.shape[0], "out")
        return torch.index_select(self.kv, 0, ids, out=out)

    def write_blocks(self, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Overwrite blocks ``block_ids`` with ``kv`` (``[n, *page_shape]``, row i -> ``block_ids[i]``).

        Raises ``InvalidKV`` on a shape, dtype or device mismatch, or on bad ids (out of range,
        duplicated, not a 1-D integer tensor); nothing is written in that case.
        """
        ids = self._check_ids(block_ids)
        self._check_kv(kv, ids.shape[0], "kv")
        self.kv.index_copy_(0, ids, kv)

    def poison(self, block_ids: torch.Tensor) -> None:
        """Fill blocks with NaN (tests: a freed block must never be read again)."""
        ids = self._check_ids(block_ids)
        self.kv.index_fill_(0, ids, float("nan"))

    # ---- validation --------------------------------------------------------------------------------

    def _check_ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(block_ids, torch.Tensor) or block_ids.dim() != 1:
            raise InvalidKV("block ids must be a 1-D tensor")
        if block_ids.dtype not in (torch.int64, torch.int32):
            raise InvalidKV(f"block ids must be integers, got {block_ids.dtype}")
        ids = block_ids.to(device=self.device, dtype=torch.int64)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_blocks:
                raise InvalidKV(f"block id out of range [0, {self.num_blocks}): {lo}..{hi}")
            if torch.unique(ids).numel() != ids.numel():
                raise InvalidKV("block ids must be distinct")
        return ids

    def _check_kv(self, kv: torch.Tensor, n: int, what: str) -> None:
        expected = (n, *self.layout.page_shape)
        if not isinstance(kv, torch.Tensor):
            raise InvalidKV(f"{what} must be a tensor")
        if tuple(kv.shape) != expected:
            raise InvalidKV(f"{what} shape {tuple(kv.shape)} != expected {expected}")
        if kv.dtype != self.kv.dtype:
            raise InvalidKV(f"{what} dtype {kv.dtype} != layout dtype {self.kv.dtype}")
        if kv.device != self.kv.device:
            raise InvalidKV(f"{what} is on {kv.device}, pages are on {self.kv.device}")
