"""The batched varlen forward computes, for every sequence in a batch, what the model computes for it
alone: mixed batches of prefills, chunked prefills and decodes, with and without cached prefixes; and
concurrent streams through the scheduler give the greedy tokens each gives alone."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.model.batched import BatchItem, _attend_fused, _attend_math, _StepIndex, forward_batch
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.pages import KVPages
from cachecore.runner import CompletionRunner, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("batch-llama", "tiny", RevisionSpec(label="r1", seed=5), device="cpu")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, pages, tokens, start, table):
    return model.forward(torch.tensor(tokens), start, torch.tensor(table), pages)[-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_of_prefills_chunks_and_decodes_equals_each_sequence_alone(loaded, seed):
    model = loaded.model
    alone_pages, batch_pages = KVPages(loaded.layout, 64, "cpu"), KVPages(loaded.layout, 64, "cpu")
    a, b, c, d = _prompt(41, seed), _prompt(23, seed + 10), _prompt(7, seed + 20), _prompt(70, seed + 30)
    ta, tb, tc, td = [5, 1, 9], [2, 3], [7], [11, 12, 13, 14, 15]
    # step 1: a's prompt but its last token, b's first chunk, d's cached prefix (48 tokens, computed
    # here as if it had been served from the cache)
    step1 = [BatchItem(a[:40], 0, ta), BatchItem(b[:10], 0, tb), BatchItem(d[:48], 0, td)]
    # step 2: a decodes, b's second chunk, c's whole prompt, d's rest after its cached prefix
    step2 = [BatchItem(a[40:], 40, ta), BatchItem(b[10:], 10, tb), BatchItem(c, 0, tc), BatchItem(d[48:], 48, td)]
    expected = [_alone(model, alone_pages, it.tokens, it.start, it.block_table) for it in step1 + step2]
    got = [*forward_batch(model, batch_pages, step1), *forward_batch(model, batch_pages, step2)]
    for want, row in zip(expected, got, strict=True):
        torch.testing.assert_close(row, want, atol=1e-5, rtol=1e-5)
        assert int(torch.argmax(row)) == int(torch.argmax(want))
    # the KV each wrote is what the model wrote alone
    used = torch.tensor(sorted(set(ta + tb + tc + td)))
    torch.testing.assert_close(batch_pages.read_blocks(used)[:, :, :, :], alone_pages.read_blocks(used),
                               atol=1e-5, rtol=1e-5)


def test_padded_decodes_never_read_other_blocks(loaded):
    pages = KVPages(loaded.layout, 16, "cpu")
    short, long = _prompt(3, 1), _prompt(37, 2)
    forward_batch(loaded.model, pages, [BatchItem(short, 0, [0]), BatchItem(long, 0, [1, 2, 3])])
    pages.poison(torch.tensor(list(range(4, 16))))  # every block nobody holds is NaN
    out = forward_batch(loaded.model, pages, [BatchItem([9], 3, [0]), BatchItem([8], 37, [1, 2, 3])])
    assert bool(torch.isfinite(out).all())
    fresh = KVPages(loaded.layout, 16, "cpu")
    forward_batch(loaded.model, fresh, [BatchItem(short, 0, [0])])
    torch.testing.assert_close(out[0], _alone(loaded.model, fresh, [9], 3, [0]), atol=1e-5, rtol=1e-5)


def test_bad_batches_raise_typed_errors_and_write_nothing(loaded):
    pages = KVPages(loaded.layout, 4, "cpu")
    with pytest.raises(InvalidPrompt):
        forward_batch(loaded.model, pages, [BatchItem([], 0, [0])])
    with pytest.raises(InvalidPrompt):
        forward_batch(loaded.model, pages, [BatchItem([1, 999], 0, [0])])
    with pytest.raises(ValueError):
        forward_batch(loaded.model, pages, [BatchItem(_prompt(20, 1), 0, [0])])  # table too short
    with pytest.raises(ValueError):
        forward_batch(loaded.model, pages, [BatchItem([1], 0, [4])])  # block outside the pages
    with pytest.raises(PromptTooLong):
        forward_batch(loaded.model, pages, [BatchItem([1], loaded.config.max_seq_len, [0])])
    with pytest.raises(ValueError):
        forward_batch(loaded.model, pages, [])
    assert not bool(pages.kv.abs().sum())  # nothing was written by any refused batch
    assert forward_batch(loaded.model, pages, [BatchItem([1, 2], 0, [0])]).shape == (1, loaded.config.vocab_size)


def test_concurrent_streams_are_batched_and_each_gives_its_greedy_tokens_alone(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=256, device="cpu")
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="batch-llama", revision="r1",
                           prefill_chunk=16)
    ns = loaded.namespace(secrets.token_bytes(32))
    system = _prompt(40, 99)
    prompts = [system + _prompt(5 + 3 * i, 200 + i) for i in range(6)] + [_prompt(30, 300)]
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    expected = [gen.complete(ns, p, owner="solo", params=params, use_cache=False).token_ids for p in prompts]
    sizes: list[int] = []
    real = gen.forward_items

    def spy(items):
        sizes.append(len(items))
        return real(items)

    gen.forward_items = spy
    results: dict[int, list[int]] = {}
    gate = threading.Barrier(len(prompts))

    def run(i):
        gate.wait()
        results[i] = gen.complete(ns, prompts[i], owner=f"t{i % 2}", params=params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(prompts))] == expected
    assert max(sizes) > 1  # they really shared forwards
    assert len(sizes) < sum(len(e) for e in expected)  # fewer forwards than tokens generated
    engine.check_integrity()
    assert engine.pool.num_in_use == 0


def test_decodes_on_a_shared_prefix_attend_it_together_and_equal_each_alone(loaded):
    """Decodes whose block tables begin with the same whole blocks (requests on one cached prefix) are
    grouped: the shared blocks are read once for the group (cascade attention, merged by log-sum-exp);
    each still gets its logits alone. Free blocks are NaN: neither part reads a block it does not hold."""
    model = loaded.model
    pages, alone = KVPages(loaded.layout, 32, "cpu"), KVPages(loaded.layout, 32, "cpu")
    prefix = _prompt(48, 7)  # 3 whole blocks: 0, 1, 2
    tables = [[0, 1, 2, 3], [0, 1, 2, 4, 5], [0, 1, 6, 10], [0, 1, 2, 7, 11], [8, 9]]
    rests = [_prompt(5, 10), _prompt(20, 11), _prompt(4, 12), _prompt(16, 13), _prompt(17, 14)]
    for target in (pages, alone):
        forward_batch(model, target, [BatchItem(prefix, 0, tables[0])])
        for i, table in enumerate(tables[:4]):  # items 0, 1, 3 share blocks 0-2; item 2 only 0-1
            keep = 32 if i == 2 else 48
            forward_batch(model, target, [BatchItem(prefix[keep:] + rests[i] if i == 2 else rests[i], keep, table)])
        forward_batch(model, target, [BatchItem(rests[4], 0, tables[4])])
    held = {b for t in tables for b in t}
    pages.poison(torch.tensor([b for b in range(32) if b not in held]))
    starts = [48 + 5, 48 + 20, 52, 48 + 16, 17]
    items = [BatchItem([3 + i], s, t) for i, (s, t) in enumerate(zip(starts, tables, strict=True))]
    idx = _StepIndex(items, BS, model.config.n_layers)
    assert [m.tolist() for m, _ in idx.groups] == [[0, 1, 2, 3]]  # item 4 starts elsewhere
    assert idx.groups[0][1].shape == (2 * BS,)  # the blocks all four share: 0 and 1
    got = forward_batch(model, pages, items)
    assert bool(torch.isfinite(got).all())
    for it, row in zip(items, got, strict=True):
        want = _alone(model, alone, it.tokens, it.start, it.block_table)
        torch.testing.assert_close(row, want, atol=1e-5, rtol=1e-5)
        assert int(torch.argmax(row)) == int(torch.argmax(want))
    # two decodes in one sequence's last block are never grouped; nor is a lone one
    assert _StepIndex(items[:1] + items[4:], BS, model.config.n_layers).groups == []


@pytest.mark.parametrize("masked", [False, True])
def test_fused_cpu_attention_and_the_written_out_form_agree_with_log_sum_exp(masked):
    """The cascade's two attention forms (``_attend_fused`` on a CPU, ``_attend_math`` elsewhere) give
    the same output and log-sum-exp within fp32 rounding, padding masked or not."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 4, 16, generator=g)
    k, v = torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    mask = None
    if masked:
        mask = torch.zeros(3, 1, 1, 40).masked_fill_(torch.arange(40) >= torch.tensor([40, 7, 1])[:, None, None, None],
                                                     float("-inf"))
    out_f, lse_f = _attend_fused(q, k, v, mask)
    out_m, lse_m = _attend_math(q, k, v, mask)
    torch.testing.assert_close(out_f, out_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_f, lse_m, atol=1e-5, rtol=1e-5)
    if masked:  # item 2 sees only position 0: its output is that value row
        torch.testing.assert_close(out_f[2], v[2, :, :1].expand(2, 4, 16), atol=1e-6, rtol=1e-6)
