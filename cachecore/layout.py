"""KV layout: the shape and dtype of one block of attention KV.

A block holds ``block_size`` consecutive token positions for every layer, K and V.
The layout is part of the cache namespace (``canonical()``), so two layouts that differ in any
field never share cached bytes.

Plain Python: the control plane reads layouts (sizes, bytes per block) without torch. Only
:func:`torch_dtype` (and ``KVLayout.torch_dtype``), which the engine's tensor code calls, imports it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The dtypes a layout may have (torch's own names) and the bytes of one element of each.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
}


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (one of ``DTYPE_BYTES``, else ``KeyError``). Engine side only: it
    imports torch, where the tensor code that asks has it loaded already."""
    if name not in DTYPE_BYTES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` of ``dtype``.

    Validated when built: positive integer sizes, ``dtype`` one of ``DTYPE_BYTES`` (else ``ValueError``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: (layers, 2 [K, V], block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for size in self.page_shape:
            n *= size
        return n * self.element_size

    def canonical(self) -> dict[str, int | str]:
        """Every field that changes the meaning of the bytes; fed to the namespace digest."""
        return {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
