"""The runner's per-step work: greedy tokens picked for the whole batch at once (and equal to what
per-request sampling picks), a token's text decoded once per id, the step's index tensors equal to the
per-token formulas, and a stream without ``should_abort`` that waits without polling."""

from __future__ import annotations

import queue
import secrets
import threading
from types import SimpleNamespace

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.model.batched import BatchItem, _StepIndex
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams


@pytest.fixture(scope="module")
def loaded():
    return load_model("loop-llama", "tiny", RevisionSpec(label="r1", seed=7), device="cpu")


@pytest.fixture
def gen(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=128, device="cpu")
    return CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="loop-llama", revision="r1")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _req(**params) -> SimpleNamespace:
    return SimpleNamespace(params=SamplingParams(**params), generator=None)


def test_greedy_tokens_equal_per_request_sampling_and_leave_the_others_to_it(gen, loaded):
    logits = torch.randn(5, loaded.config.vocab_size, generator=torch.Generator().manual_seed(1))
    masked = next(i for i in range(loaded.config.vocab_size) if i not in set(loaded.tokenizer.generatable_ids()))
    logits[3, masked] = 1e4  # an id generation may not pick stays unpicked
    logits[4, 40] = logits[4, 50] = 1e3  # a tie: the first maximum, as per-request argmax
    reqs = [_req(), _req(logprobs=2), _req(temperature=0.7, seed=3), _req(), _req()]
    picks = gen.greedy_tokens(logits, reqs)
    assert picks[1] is None and picks[2] is None  # logprobs and sampling: ``sample`` picks theirs
    for i in (0, 3, 4):
        assert picks[i] == gen.sample(logits[i], reqs[i])[0]
    assert picks[3] != masked and picks[4] == 40
    assert gen.greedy_tokens(logits[:1], [_req(temperature=1.0)]) == [None]


def test_greedy_streams_are_not_sampled_one_by_one_and_others_still_are(gen, loaded):
    ns = loaded.namespace(secrets.token_bytes(32))
    calls = []
    real = gen.sample
    gen.sample = lambda logits, req: calls.append(req.params) or real(logits, req)
    greedy = SamplingParams(max_tokens=6, stop_at_eos=False)
    tokens = gen.complete(ns, _prompt(20, 1), owner="a", params=greedy).token_ids
    assert len(tokens) == 6 and calls == []
    assert tokens == gen.complete(ns, _prompt(20, 1), owner="a", params=greedy, use_cache=False).token_ids
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=5, stop_at_eos=False)
    first = gen.complete(ns, _prompt(20, 2), owner="a", params=seeded).token_ids
    assert len(calls) == 4 and first == gen.complete(ns, _prompt(20, 2), owner="a", params=seeded).token_ids


def test_a_tokens_text_is_decoded_once_per_id(gen):
    seen = []
    real = gen.tokenizer.decode
    gen.tokenizer = SimpleNamespace(decode=lambda ids: seen.append(list(ids)) or real(ids))
    assert [gen.decode_token(t) for t in (65, 66, 65, 65)] == [real([65]), real([66]), real([65]), real([65])]
    assert seen == [[65], [66]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_index_equals_the_per_token_formulas(seed):
    g = torch.Generator().manual_seed(seed)
    bs, layers = 4, 3
    items = []
    for _ in range(6):
        start = int(torch.randint(0, 20, (1,), generator=g))
        n = 1 if torch.rand(1, generator=g) < 0.5 else int(torch.randint(2, 9, (1,), generator=g))
        blocks = -(-(start + n) // bs) + int(torch.randint(0, 3, (1,), generator=g))  # tables may be longer
        items.append(BatchItem(list(range(n)), start, torch.randperm(40, generator=g)[:blocks].tolist()))
    idx = _StepIndex(items, bs, layers)
    pos = [p for it in items for p in range(it.start, it.start + len(it.tokens))]
    slots = [it.block_table[p // bs] * bs + p % bs for it in items for p in range(it.start, it.start + len(it.tokens))]
    assert idx.pos.tolist() == pos and idx.slots.tolist() == slots
    assert idx.last.tolist() == [idx.offsets[i + 1] - 1 for i in range(len(items))]
    decode = [i for i, it in enumerate(items) if len(it.tokens) == 1]
    assert idx.decode == decode and idx.chunks == [i for i in range(len(items)) if i not in decode]
    if decode:
        width = max(items[i].start + 1 for i in decode)
        for row, i in enumerate(decode):
            it, n = items[i], items[i].start + 1
            want = [it.block_table[p // bs] * layers * 2 * bs + p % bs for p in range(n)]
            assert idx.decode_base[row].tolist() == want + [want[0]] * (width - n)  # padding: its own slot 0
            assert idx.decode_rows[row] == idx.offsets[i]
            if idx.decode_mask is not None:
                assert idx.decode_mask[row, 0, 0].tolist() == [True] * n + [False] * (width - n)


def test_a_stream_without_should_abort_waits_for_its_events_without_polling(gen, loaded, monkeypatch):
    gets = []

    class Counting(queue.Queue):
        def get(self, block=True, timeout=None):
            gets.append(timeout)
            return super().get(block, timeout)

    real = gen.scheduler.submit
    monkeypatch.setattr(gen.scheduler, "submit", lambda req: (setattr(req, "events", Counting()), real(req))[1])
    ns = loaded.namespace(secrets.token_bytes(32))
    events = list(gen.stream(ns, _prompt(10, 3), owner="a", params=SamplingParams(max_tokens=3, stop_at_eos=False)))
    assert len(events) == 5 and gets == [None] * 5  # Prefilled, 3 tokens, Finished: one wait each
    aborted = threading.Event()
    gets.clear()
    list(gen.stream(ns, _prompt(10, 4), owner="a", params=SamplingParams(max_tokens=2, stop_at_eos=False),
                    should_abort=aborted.is_set))
    assert gets and all(t is not None for t in gets)  # with should_abort it polls it while it waits
