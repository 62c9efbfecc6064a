"""KVLayout, KVPages and pick_device: bytes in, the same bytes out, bad input refused."""

from __future__ import annotations

import pytest
import torch

from cachecore.device import pick_device
from cachecore.errors import InvalidKV
from cachecore.layout import KVLayout
from cachecore.pages import KVPages

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture
def pages() -> KVPages:
    return KVPages(LAYOUT, num_blocks=10, device=pick_device())


def _rand_blocks(n: int, pages: KVPages, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.page_shape), generator=g).to(pages.device)


def test_layout_shape_bytes_and_canonical():
    assert LAYOUT.page_shape == (3, 2, 4, 2, 8)
    assert LAYOUT.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4
    assert KVLayout(3, 2, 8, 4, "bfloat16").bytes_per_block == LAYOUT.bytes_per_block // 2
    assert LAYOUT.canonical() == {
        "dtype": "float32",
        "block_size": 4,
        "num_layers": 3,
        "num_kv_heads": 2,
        "head_dim": 8,
    }
    assert LAYOUT.canonical() != KVLayout(3, 2, 8, 16).canonical()


@pytest.mark.parametrize(
    "kwargs",
    [{"num_layers": 0}, {"head_dim": -1}, {"block_size": 2.0}, {"dtype": "int8"}, {"num_kv_heads": True}],
)
def test_layout_rejects_bad_fields(kwargs):
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8} | kwargs
    with pytest.raises(ValueError):
        KVLayout(**fields)


def test_pages_built_under_inference_mode_stay_writable():
    with torch.inference_mode():
        pages = KVPages(LAYOUT, num_blocks=2, device=pick_device())
    pages.write_blocks(torch.tensor([1]), _rand_blocks(1, pages))


def test_page_tensor_is_block_major_and_preallocated(pages):
    assert pages.kv.shape == (10, *LAYOUT.page_shape)
    assert pages.kv.is_contiguous()
    assert pages.nbytes == 10 * LAYOUT.bytes_per_block


def test_write_blocks_then_read_blocks_roundtrip_in_any_order(pages):
    ids = torch.tensor([7, 2, 5])
    kv = _rand_blocks(3, pages)
    pages.write_blocks(ids, kv)
    assert torch.equal(pages.read_blocks(ids), kv)
    assert torch.equal(pages.read_blocks(torch.tensor([5, 7])), kv[[2, 0]])
    out = torch.empty_like(kv)
    assert pages.read_blocks(ids, out=out) is out and torch.equal(out, kv)
    # untouched blocks stay untouched
    assert torch.count_nonzero(pages.read_blocks(torch.tensor([0, 1, 3]))) == 0


def test_read_blocks_returns_a_copy(pages):
    ids = torch.tensor([1])
    pages.write_blocks(ids, _rand_blocks(1, pages))
    copy = pages.read_blocks(ids)
    copy.zero_()
    assert torch.count_nonzero(pages.read_blocks(ids)) > 0


def test_write_layer_then_gather_with_shuffled_block_table(pages):
    bs, length = LAYOUT.block_size, 11  # 2 full blocks + 3 positions of a third
    table = torch.tensor([8, 3, 6])  # non-contiguous, not sorted
    g = torch.Generator().manual_seed(1)
    k = torch.randn(length, 2, 8, generator=g).to(pages.device)
    v = torch.randn(length, 2, 8, generator=g).to(pages.device)
    pos = torch.arange(length)
    slots = table[pos // bs] * bs + pos % bs
    perm = torch.randperm(length, generator=g)  # write order must not matter
    pages.write_layer(1, slots[perm], k[perm], v[perm])
    got_k, got_v = pages.gather_layer(1, table, length)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # other layers and other blocks untouched
    assert torch.count_nonzero(pages.gather_layer(0, table, length)[0]) == 0
    assert torch.count_nonzero(pages.read_blocks(torch.tensor([0, 1, 2, 4, 5, 7, 9]))) == 0
    # the layer data sits where the page layout says: block 3 holds positions 4..7, K at [.., 0, ..]
    assert torch.equal(pages.kv[3, 1, 0], k[4:8]) and torch.equal(pages.kv[3, 1, 1], v[4:8])


def test_write_layer_with_rows_computed_once_writes_where_slots_say_for_every_layer(pages):
    """``slot_rows`` computed once serves every layer's write: the same bytes as ``write_layer`` working out
    the rows itself, layer by layer, at the positions of the page layout."""
    bs, table = LAYOUT.block_size, torch.tensor([7, 2, 5])
    pos = torch.arange(1, 10)
    slots = (table[pos // bs] * bs + pos % bs).to(pages.device)
    rows = pages.slot_rows(slots)
    assert rows.shape == (2 * len(pos),)
    other = KVPages(LAYOUT, num_blocks=10, device=pages.device)
    g = torch.Generator().manual_seed(2)
    for layer in range(LAYOUT.num_layers):
        k, v = (torch.randn(len(pos), 2, 8, generator=g).to(pages.device) for _ in range(2))
        pages.write_layer(layer, slots, k, v, rows=rows)
        other.write_layer(layer, slots, k, v)
        assert torch.equal(pages.gather_layer(layer, table, 10)[0][1:], k)
        assert torch.equal(pages.kv[2, layer, 1, :2], v[3:5])  # block 2 holds positions 4..7
    assert torch.equal(pages.kv, other.kv)
    assert (pages.kv.flatten(1).abs().sum(1) != 0).nonzero().flatten().tolist() == [2, 5, 7]  # only the table's


def test_gather_reads_only_needed_blocks_and_positions(pages):
    table = torch.tensor([4, 9])
    pages.poison(torch.tensor([9]))
    pos = torch.arange(4)
    kv = torch.ones(4, 2, 8, device=pages.device)
    pages.write_layer(0, table[0] * 4 + pos, kv, kv)
    k, v = pages.gather_layer(0, table, 4)  # exactly one block: the poisoned second one is not read
    assert not torch.isnan(k).any() and not torch.isnan(v).any()
    pages.write_layer(0, torch.tensor([9 * 4]), kv[:1], kv[:1])  # position 4 -> block 9 offset 0
    k, _ = pages.gather_layer(0, table, 5)  # offsets 1..3 of block 9 are NaN but beyond length
    assert k.shape == (5, 2, 8) and not torch.isnan(k).any()
    with pytest.raises(ValueError):
        pages.gather_layer(0, table, 9)


def test_poison_fills_nan_only_in_named_blocks(pages):
    pages.poison(torch.tensor([2, 6]))
    assert torch.isnan(pages.read_blocks(torch.tensor([2, 6]))).all()
    assert not torch.isnan(pages.read_blocks(torch.tensor([0, 1, 3, 4, 5, 7, 8, 9]))).any()
    pages.write_blocks(torch.tensor([2]), _rand_blocks(1, pages))
    assert not torch.isnan(pages.read_blocks(torch.tensor([2]))).any()


@pytest.mark.parametrize(
    "make_kv",
    [
        lambda p: _rand_blocks(2, p)[:, :, :1],  # wrong shape
        lambda p: _rand_blocks(3, p),  # wrong block count
        lambda p: _rand_blocks(2, p).to(torch.float16),  # wrong dtype
        lambda p: _rand_blocks(2, p).tolist(),  # not a tensor
    ],
)
def test_write_blocks_rejects_mismatched_kv_and_writes_nothing(pages, make_kv):
    with pytest.raises(InvalidKV):
        pages.write_blocks(torch.tensor([0, 1]), make_kv(pages))
    assert torch.count_nonzero(pages.kv) == 0


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([0, 10]),
        torch.tensor([-1, 0]),
        torch.tensor([3, 3]),
        torch.tensor([[0, 1]]),
        torch.tensor([0.0, 1.0]),
    ],
)
def test_bad_block_ids_raise_invalid_kv(pages, ids):
    with pytest.raises(InvalidKV):
        pages.write_blocks(ids, _rand_blocks(2, pages))
    with pytest.raises(InvalidKV):
        pages.read_blocks(ids)


def test_write_layer_rejects_mismatched_kv(pages):
    with pytest.raises(InvalidKV):
        pages.write_layer(0, torch.tensor([0, 1]), torch.zeros(2, 2, 8), torch.zeros(1, 2, 8))


def test_pick_device_env_overrides_and_defaults(monkeypatch):
    monkeypatch.delenv("STRATA_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == expected
    assert pick_device("auto").type == expected
    assert pick_device("cpu").type == "cpu"
    monkeypatch.setenv("STRATA_DEVICE", "cpu")
    assert pick_device("cuda").type == "cpu"
    monkeypatch.setenv("STRATA_DEVICE", "not-a-device")
    with pytest.raises(ValueError):
        pick_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("STRATA_DEVICE", "cuda")
        with pytest.raises(ValueError):
            pick_device()
