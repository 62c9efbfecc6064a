"""Property tests of the scheduler (hypothesis): random arrivals, lengths, cancellations, tenants and
pool sizes over a real engine, with a model-free runner whose next token is a function of the tokens
so far (so batching, chunking and preemption cannot change a request's output without showing).

Every request finishes or fails cleanly (a typed error), no block leaks, integrity holds after every
step, outputs equal the request run alone, and without block pressure no request waits in the queue
longer than the aging bound (age_steps plus one step per request that arrived before it)."""

from __future__ import annotations

import secrets

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachecore.engine import CacheEngine
from cachecore.errors import CacheError, OutOfBlocks
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.scheduler import Failed, Finished, Request, Scheduler, State, TokenOut

VOCAB, EOS = 11, 0


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 7 + len(tokens)) % VOCAB


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        out.append(t)
        if t == EOS:
            break
        tokens.append(t)
    return out


class FakeRunner:
    """Runner protocol without a model: the logits of a position pick ``next_token`` of the prefix."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def forward_items(self, items):
        self.batches.append(len(items))
        rows = torch.full((len(items), VOCAB), -1.0)
        for i, (seq, start, end) in enumerate(items):
            assert start == seq.num_computed, "a chunk must continue where the sequence's KV ends"
            assert end <= len(seq.tokens)
            rows[i, next_token(seq.tokens[:end])] = 1.0
        return rows

    def sample(self, logits, req):
        return int(torch.argmax(logits)), None, None

    def decode_token(self, token):
        return str(token)

    def stops(self, token, req):
        return token == EOS


@pytest.fixture(scope="module")
def layout():
    return load_model("prop-llama", "tiny", RevisionSpec(label="r1", seed=1), device="cpu").layout


def _ns():
    loaded = load_model("prop-llama", "tiny", RevisionSpec(label="r1", seed=1), device="cpu")
    return loaded.namespace(secrets.token_bytes(32))


NS = None


spec = st.fixed_dictionaries({
    "arrival": st.integers(0, 12),
    "tenant": st.sampled_from(["a", "b", "c"]),
    "prefix": st.sampled_from([0, 1, 2]),  # requests share one of three system prompts
    "prefix_len": st.integers(0, 48),
    "suffix_len": st.integers(1, 40),
    "max_tokens": st.integers(0, 40),
    "cancel_at": st.one_of(st.none(), st.integers(0, 30)),
})


def _drive(layout, reqs_spec, *, num_blocks, budget, max_batch, age_steps, policy, chunk):
    global NS
    NS = NS or _ns()
    engine = CacheEngine(layout, num_blocks=num_blocks, device="cpu")
    sched = Scheduler(engine, token_budget=budget, max_batch=max_batch, age_steps=age_steps, policy=policy,
                      start_thread=False)
    runner = FakeRunner()
    systems = [[(17 * p + i) % VOCAB for i in range(48)] for p in range(3)]
    reqs: list[tuple[dict, Request | None, BaseException | None]] = []
    pending = sorted(enumerate(reqs_spec), key=lambda x: x[1]["arrival"])
    step = 0
    while pending or any(r is not None and not r.done.is_set() for _, r, _ in reqs):
        while pending and pending[0][1]["arrival"] <= step:
            _, s = pending.pop(0)
            prompt = systems[s["prefix"]][: s["prefix_len"]] + [(3 * i + 1) % VOCAB for i in range(s["suffix_len"])]
            req = Request(owner=s["tenant"], runner=runner, ns=NS, prompt=prompt, max_tokens=s["max_tokens"],
                          admit_kwargs={"model": "prop-llama", "revision": "r1"}, chunk=chunk)
            try:
                sched.submit(req)
                reqs.append((s, req, None))
            except CacheError as exc:
                reqs.append((s, None, exc))
        for s, req, _ in reqs:
            if req is not None and s["cancel_at"] == step:
                sched.cancel(req, wait=False)
        sched.step()
        engine.check_integrity()
        step += 1
        assert step < 5000, ("the scheduler stopped making progress", sched.snapshot(), engine.pool.num_free,
                             [(r.rid, r.owner, r.state.value, r.seq is not None, len(r.tokens), r.max_tokens,
                               r.seq.num_computed if r.seq else None) for r in sched.waiting + sched.running])
    return engine, sched, reqs


def _check_clean(engine, reqs):
    for s, req, err in reqs:
        if req is None:
            assert isinstance(err, CacheError)  # refused at submit, typed, nothing held
            continue
        assert req.state is State.DONE and (req.seq is None or req.seq.released)
        events = []
        while not req.events.empty():
            events.append(req.events.get())
        assert events, "every request ends with an event"
        last = events[-1]
        if isinstance(last, Failed):
            assert isinstance(last.error, OutOfBlocks)
            continue
        assert isinstance(last, Finished)
        tokens = [e.token_id for e in events if isinstance(e, TokenOut)]
        if last.finish_reason == "aborted":
            assert tokens == alone(req.prompt, req.max_tokens)[: len(tokens)]
        else:
            assert tokens == alone(req.prompt, req.max_tokens), "batching changed a request's output"
    assert engine.pool.num_in_use == 0, "blocks leaked"
    assert not engine.running()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(spec, min_size=1, max_size=14), num_blocks=st.integers(3, 40),
       budget=st.integers(5, 64), chunk=st.integers(1, 48), policy=st.sampled_from(["cache_aware", "fcfs"]))
def test_every_request_finishes_or_fails_cleanly_under_any_pool_size(layout, reqs, num_blocks, budget, chunk, policy):
    max_batch = max(1, budget // 2)
    engine, sched, out = _drive(layout, reqs, num_blocks=num_blocks, budget=budget, max_batch=max_batch,
                                age_steps=6, policy=policy, chunk=chunk)
    _check_clean(engine, out)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(spec.map(lambda s: {**s, "cancel_at": None}), min_size=1, max_size=14),
       budget=st.integers(16, 64), chunk=st.integers(1, 48), age_steps=st.integers(1, 8))
def test_without_block_pressure_no_request_waits_longer_than_the_aging_bound(layout, reqs, budget, chunk, age_steps):
    engine, sched, out = _drive(layout, reqs, num_blocks=400, budget=budget, max_batch=15, age_steps=age_steps,
                                policy="cache_aware", chunk=chunk)
    _check_clean(engine, out)
    admitted = sorted((r for _, r, _ in out if r is not None), key=lambda r: r.rid)
    for i, req in enumerate(admitted):
        assert req.preemptions == 0
        assert req.waited_steps <= age_steps + i + 1, (req.rid, req.waited_steps)
    assert sched.counters["max_wait_steps"] == max((r.waited_steps for r in admitted), default=0)
