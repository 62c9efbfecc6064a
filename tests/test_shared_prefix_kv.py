"""SharedPrefixKV keeps the K/V of the blocks decode groups share between steps: the logits are
bitwise those of a fresh copy each step, a kept copy is used again only while no write touched its
blocks (a freed block id reused for another tenant's bytes, by a restore or a prefill, is read anew),
copies a step did not use are dropped, and none passes the byte bound."""

from __future__ import annotations

import pytest
import torch

from cachecore.model.batched import BatchItem, forward_batch
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.model.shared_kv import SharedPrefixKV
from cachecore.pages import KVPages

BS = 16
PREFIX_BLOCKS = [0, 1, 2]


@pytest.fixture(scope="module")
def loaded():
    return load_model("batch-llama", "tiny", RevisionSpec(label="r1", seed=5), device="cpu")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _filled(loaded, prefix_seed: int = 7) -> tuple[KVPages, list[list[int]], list[int]]:
    """Pages holding a 48-token prefix (blocks 0-2) and three requests on it, each 5 tokens on."""
    pages = KVPages(loaded.layout, 32, "cpu")
    tables = [[*PREFIX_BLOCKS, 3 + i] for i in range(3)]
    forward_batch(loaded.model, pages, [BatchItem(_prompt(48, prefix_seed), 0, tables[0])])
    for i, table in enumerate(tables):
        forward_batch(loaded.model, pages, [BatchItem(_prompt(5, 20 + i), 48, table)])
    return pages, tables, [53] * 3


def _step(loaded, pages, tables, starts, shared_kv, token=3):
    return forward_batch(loaded.model, pages, [BatchItem([token + i], s, t) for i, (s, t) in
                                               enumerate(zip(starts, tables, strict=True))], shared_kv)


def test_kept_copies_give_bitwise_the_logits_of_a_fresh_read_step_after_step(loaded):
    kept_pages, tables, starts = _filled(loaded)
    plain_pages, _, _ = _filled(loaded)
    shared = SharedPrefixKV(1 << 30)
    for step in range(4):
        got = _step(loaded, kept_pages, tables, [s + step for s in starts], shared, token=3 + step)
        want = _step(loaded, plain_pages, tables, [s + step for s in starts], None, token=3 + step)
        assert torch.equal(got, want)
    assert shared.copies_taken == 1 and shared.hits == 3  # one copy of blocks 0-2, used by three more steps
    assert shared.nbytes == len(PREFIX_BLOCKS) * loaded.layout.bytes_per_block


@pytest.mark.parametrize("rewrite", ["restore", "prefill", "poison"])
def test_a_block_id_written_again_is_read_anew_never_from_the_kept_copy(loaded, rewrite):
    """The attack a stale copy would allow: the shared blocks are freed and their ids reused for
    another tenant's prefix; requests on that prefix must attend its bytes, not the first tenant's."""
    pages, tables, starts = _filled(loaded)
    shared = SharedPrefixKV(1 << 30)
    _step(loaded, pages, tables, starts, shared)  # copy of the first prefix kept
    other, _, _ = _filled(loaded, prefix_seed=99)  # another tenant's prefix in the same block ids
    if rewrite == "restore":  # an L2/L3 load into the reused ids
        pages.write_blocks(torch.tensor(PREFIX_BLOCKS), other.read_blocks(torch.tensor(PREFIX_BLOCKS)))
    elif rewrite == "prefill":  # a prefill computed into them
        forward_batch(loaded.model, pages, [BatchItem(_prompt(48, 99), 0, tables[0])])
    else:
        pages.poison(torch.tensor(PREFIX_BLOCKS))
    got = _step(loaded, pages, tables, starts, shared)
    assert shared.copies_taken == 2 and shared.hits == 0
    if rewrite == "poison":
        assert not bool(torch.isfinite(got).any())  # the poisoned bytes were read, not the old copy
        return
    fresh = _step(loaded, pages, tables, starts, None)
    assert torch.equal(got, fresh)
    assert not torch.equal(got, _step(loaded, _filled(loaded)[0], tables, starts, None))


def test_copies_a_step_does_not_use_are_dropped_and_none_passes_the_bound(loaded):
    pages, tables, starts = _filled(loaded)
    shared = SharedPrefixKV(1 << 30)
    _step(loaded, pages, tables, starts, shared)
    assert shared.nbytes > 0
    forward_batch(loaded.model, pages, [BatchItem([5], starts[0], tables[0])], shared)  # no group this step
    assert shared.nbytes == 0
    tight = SharedPrefixKV(len(PREFIX_BLOCKS) * loaded.layout.bytes_per_block - 1)
    plain = _step(loaded, pages, tables, [s + 1 for s in starts], None, token=7)
    again, _, _ = _filled(loaded)
    _step(loaded, again, tables, starts, None)
    forward_batch(loaded.model, again, [BatchItem([5], starts[0], tables[0])])
    assert torch.equal(_step(loaded, again, tables, [s + 1 for s in starts], tight, token=7), plain)
    assert tight.nbytes == 0 and tight.copies_taken == 0  # attended from a per-layer read instead
    with pytest.raises(ValueError):
        SharedPrefixKV(-1)
