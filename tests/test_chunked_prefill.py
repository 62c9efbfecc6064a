"""A prompt prefilled in chunks (some starting mid-block, over scattered blocks, with grouped-query
heads) gives the logits the same prompt gives in one forward, through ``LlamaModel.forward`` alone
and through ``forward_batch``: a chunk after cached positions attends them read back from the pages,
causal within itself."""

from __future__ import annotations

import pytest
import torch

from cachecore.model.batched import BatchItem, forward_batch
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.pages import KVPages


@pytest.fixture(scope="module")
def loaded():
    return load_model("chunk-llama", "tiny", RevisionSpec(label="r1", seed=11), device="cpu")


@pytest.mark.parametrize("chunk", [7, 16, 40])
def test_chunked_prefill_equals_one_forward_alone_and_batched(loaded, chunk):
    model, bs = loaded.model, loaded.layout.block_size
    assert model.config.n_kv_heads < model.config.n_heads  # grouped-query attention
    tokens = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(chunk)).tolist()
    blocks = -(-len(tokens) // bs)
    table = [int(b) for b in torch.randperm(blocks + 4)[:blocks]]  # scattered, as a pool hands them out
    whole = model.forward(torch.tensor(tokens), 0, torch.tensor(table), KVPages(loaded.layout, blocks + 4, "cpu"))
    starts = list(range(0, len(tokens), chunk))
    assert any(s % bs for s in starts) == bool(chunk % bs)  # 7 and 40: chunks that start mid-block
    alone_pages, batch_pages = KVPages(loaded.layout, blocks + 4, "cpu"), KVPages(loaded.layout, blocks + 4, "cpu")
    for s in starts:
        part = tokens[s:s + chunk]
        alone = model.forward(torch.tensor(part), s, torch.tensor(table), alone_pages)
        batched = forward_batch(model, batch_pages, [BatchItem(part, s, table)])[0]
        want = whole[s + len(part) - 1]
        for row in (alone[-1], batched):
            torch.testing.assert_close(row, want, atol=1e-5, rtol=1e-5)
            assert int(torch.argmax(row)) == int(torch.argmax(want))
        torch.testing.assert_close(alone, whole[s:s + len(part)], atol=1e-5, rtol=1e-5)
    # and batched chunks wrote the KV the chunks wrote alone
    used = torch.tensor(table)
    torch.testing.assert_close(batch_pages.read_blocks(used), alone_pages.read_blocks(used), atol=1e-5, rtol=1e-5)
