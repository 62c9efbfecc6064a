"""``Linear``: the decoder's weight matmuls (oneDNN over a reordered weight on a CPU, else F.linear)."""

import pytest
import torch
import torch.nn.functional as F

from cachecore.model.linear import Linear, onednn_packs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_linear_equals_f_linear_within_rounding(bias, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80, generator=g)
    lin = Linear(w.clone(), b)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    column_major = x.t().contiguous().t()  # a strided input (a slice of a fused projection is one)
    torch.testing.assert_close(lin(column_major), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_a_cpu_fp32_weight_is_held_reordered_once_and_given_back_exactly():
    w = torch.randn(64, 32)
    lin = Linear(w.clone())
    assert lin.onednn == onednn_packs(w) == torch.backends.mkldnn.is_available()
    assert torch.equal(lin.weight, w)
    if lin.onednn:
        assert lin._plain is None  # no second copy of the weight


def test_unpackable_weights_and_pack_false_keep_the_plain_tensor():
    half = torch.randn(8, 4, dtype=torch.float16)
    assert not onednn_packs(half) and Linear(half).weight is half
    shared = torch.randn(8, 4)
    lin = Linear(shared, pack=False)  # a tied embedding: the same tensor, no reordered copy
    assert not lin.onednn and lin.weight is shared
    x = torch.randn(3, 4)
    assert torch.equal(lin(x), F.linear(x, shared))
