"""``Linear``: one weight matmul of the reference engine (``x @ weight.T + bias``, as ``F.linear``).

On a CPU with oneDNN (torch's ``mkldnn`` backend) and a float32 or bfloat16 weight, the weight is
reordered once, at load, into oneDNN's blocked layout and applied with oneDNN's linear primitive: the
kernel vLLM's CPU build uses for its dense layers (``create_onednn_mm``). Measured on this project's
2-core machine (1 thread, AVX-512), ``[3072, 512]`` weight: 16 rows 732 -> 496 us, 1 row 159 -> 105 us,
512 rows 17.8 -> 15.1 ms against ``F.linear`` (MKL on the plain weight). The values are
``F.linear``'s within fp32 rounding (the sums run in another order), as a batched call's already were.

The reordered weight replaces the plain one (no second copy); ``weight`` gives the plain values back
(exactly: the reorder only moves them). Elsewhere (CUDA, float16, a torch without oneDNN, or a reorder
that fails) it is ``F.linear`` on the plain weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Linear", "onednn_packs"]

_HINT_ROWS = 32  # the row count oneDNN picks its weight layout for (vLLM's choice; 1..512 measured alike)


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether ``Linear`` runs ``weight`` through oneDNN (the module docstring's conditions)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """``weight`` ``[out, in]`` (and ``bias`` ``[out]`` or None) applied to ``x`` ``[..., in]``;
    ``pack=False`` keeps the plain weight (one shared with another use, such as a tied embedding)."""

    __slots__ = ("_plain", "_packed", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.bias = bias
        self._plain: torch.Tensor | None = weight
        self._packed: torch.Tensor | None = None
        if pack and onednn_packs(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _HINT_ROWS)
            except RuntimeError:  # a oneDNN build without this primitive: the plain matmul
                return
            self._plain = None

    @property
    def onednn(self) -> bool:
        return self._packed is not None

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight ``[out, in]`` (a fresh dense copy when it is held reordered)."""
        return self._plain if self._packed is None else self._packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self._plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
