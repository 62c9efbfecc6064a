"""Compute fairness under a flood: the step policy (``cachecore.scheduler.fairness``) on its own, and the
scheduler with it (a flooding tenant's running decodes and prefill chunks beside a victim's request).
Steps are counted, never timed."""

from __future__ import annotations

import secrets

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams
from cachecore.scheduler import Request, Scheduler, State, TokenOut
from cachecore.scheduler.fairness import RecentTenants, TenantDemand, plan_step, slot_shares, step_budget, water_fill
from tests.test_scheduler_property import FakeRunner, alone

BS = 16


# ---------------------------------------------------------------- the policy alone
def test_a_victim_with_one_request_gets_its_share_beside_a_flooder_with_thirty_running():
    flooder = TenantDemand("a", 1.0, vtime=5000.0, tokens=30 + 30 * 256, prefill_first=True)
    victim = TenantDemand("b", 1.0, vtime=5000.0, tokens=256, prefill_first=True)
    shares = plan_step([flooder, victim], budget=512, lean_budget=32)
    assert shares.allowance == {"a": 256, "b": 256} and not shares.lean  # max-min: its whole chunk
    small = TenantDemand("b", 1.0, vtime=5000.0, tokens=8, prefill_first=True)
    shares = plan_step([flooder, small], budget=512, lean_budget=32)
    assert shares.allowance == {"a": 504, "b": 8}  # what the victim leaves goes to the flooder


def test_a_victim_below_its_share_gets_a_short_step_for_its_first_token():
    flooder = TenantDemand("a", 1.0, vtime=5000.0, tokens=30 + 30 * 256, prefill_first=True)
    victim = TenantDemand("b", 1.0, vtime=4000.0, tokens=256, prefill_first=True)
    shares = plan_step([flooder, victim], budget=512, lean_budget=32)
    assert shares.lean and shares.urgent == "b" and shares.order[0] == "b"
    assert shares.allowance == {"b": 256, "a": 32} and shares.budget == 288
    decoding = TenantDemand("b", 1.0, vtime=4000.0, tokens=1, prefill_first=False)
    assert not plan_step([flooder, decoding], budget=512, lean_budget=32).lean  # no first token waits
    strict = plan_step([flooder, victim], budget=512, lean_budget=0)  # STRATA_LEAN_BUDGET=0
    assert strict.lean and strict.allowance.get("a", 0) == 0 and strict.budget == 256


def test_weights_split_the_budget_in_proportion():
    demands = {"heavy": 10_000, "light": 10_000}
    assert water_fill(demands, {"heavy": 3.0, "light": 1.0}, 512) == {"heavy": 384, "light": 128}
    assert water_fill(demands, {"heavy": 1.0, "light": 1.0}, 512) == {"heavy": 256, "light": 256}
    # a tenant under its weighted share keeps its demand; the rest is split by weight among the others
    three = water_fill({"a": 10_000, "b": 10_000, "c": 20}, {"a": 2.0, "b": 1.0, "c": 1.0}, 500)
    assert three == {"a": 320, "b": 160, "c": 20}


def test_a_tenant_alone_gets_the_whole_budget_and_shares_are_work_conserving():
    alone_shares = plan_step([TenantDemand("a", 1.0, 0.0, 10_000, True)], budget=512, lean_budget=32)
    assert alone_shares.allowance == {"a": 512} and not alone_shares.lean
    for budget in (1, 7, 100, 513):
        alloc = water_fill({"a": 300, "b": 5, "c": 90, "d": 0}, {"a": 1.0, "b": 2.0, "c": 3.0, "d": 1.0}, budget)
        assert sum(alloc.values()) == min(budget, 395)
        assert all(alloc[o] <= d for o, d in {"a": 300, "b": 5, "c": 90, "d": 0}.items())


def test_running_slots_are_split_by_weight_between_tenants_with_requests():
    assert slot_shares({"a": 40, "b": 1}, {"a": 1.0, "b": 1.0}, 32) == {"a": 31, "b": 1}
    assert slot_shares({"a": 40, "b": 40}, {"a": 3.0, "b": 1.0}, 32) == {"a": 24, "b": 8}
    assert slot_shares({"a": 40}, {"a": 1.0}, 32) == {"a": 32}


# ---------------------------------------------------------------- the scheduler with it
class Recording(FakeRunner):
    """FakeRunner that keeps each step's items, to see who got how many tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[tuple]] = []

    def forward_items(self, items):
        self.steps.append([(seq, start, end) for seq, start, end in items])
        return super().forward_items(items)


@pytest.fixture(scope="module")
def loaded():
    return load_model("fair-llama", "tiny", RevisionSpec(label="r1", seed=3), device="cpu")


@pytest.fixture
def ns(loaded):
    return loaded.namespace(secrets.token_bytes(32))


def _req(runner, ns, owner, prompt, max_tokens, chunk=32, params=None) -> Request:
    return Request(owner=owner, runner=runner, ns=ns, prompt=prompt, max_tokens=max_tokens,
                   admit_kwargs={"model": "fair-llama", "revision": "r1"}, chunk=chunk, params=params)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _flooded(sched: Scheduler, runner, ns, *, running: int, waiting: int) -> list[Request]:
    """Tenant ``a`` with ``running`` requests decoding and ``waiting`` more queued behind them."""
    flood = [sched.submit(_req(runner, ns, "a", [i % 11 + 1] * 20, 400)) for i in range(running)]
    for _ in range(200):
        sched.step()
        if all(r.state is State.RUNNING and r.prefilled for r in flood):
            break
    assert all(r.prefilled for r in flood)
    flood += [sched.submit(_req(runner, ns, "a", [(i + 5) % 11] * 200, 400)) for i in range(waiting)]
    sched.step()
    return flood


def test_the_victims_chunk_is_in_the_next_step_beside_thirty_running_flood_requests(ns):
    engine = CacheEngine(ns_layout(), num_blocks=2000, device="cpu")
    sched = Scheduler(engine, token_budget=512, max_batch=40, lean_budget=16, start_thread=False)
    runner = Recording()
    _flooded(sched, runner, ns, running=30, waiting=10)
    victim = sched.submit(_req(runner, ns, "b", [200 + i % 50 for i in range(300)], 2, chunk=256))
    sched.step()
    items = runner.steps[-1]
    mine = [(s, e) for seq, s, e in items if seq is victim.seq]
    assert mine == [(0, 256)]  # its whole chunk, >= its fair share of the budget (256)
    others = sum(e - s for seq, s, e in items if seq is not victim.seq)
    assert others <= 16  # the step carrying its first token is bounded: the flood's decodes wait a step
    assert sched.counters["lean_steps"] >= 1
    sched.step()
    assert victim.prefilled  # its first token after two steps of the flood's hundreds


def ns_layout():
    return load_model("fair-llama", "tiny", RevisionSpec(label="r1", seed=3), device="cpu").layout


def test_a_flooder_alone_uses_the_whole_budget(ns):
    engine = CacheEngine(ns_layout(), num_blocks=2000, device="cpu")
    sched = Scheduler(engine, token_budget=128, max_batch=16, start_thread=False)
    runner = Recording()
    flood = [sched.submit(_req(runner, ns, "a", [(i + 2) % 11] * 100, 3)) for i in range(8)]
    for _ in range(3):
        sched.step()
    assert [sum(e - s for _, s, e in step) for step in runner.steps] == [128, 128, 128]
    assert sched.counters["lean_steps"] == 0
    while not all(r.done.is_set() for r in flood):
        sched.step()


def test_a_tenant_at_its_slot_share_starts_nothing_more_while_another_waits(ns):
    """Tenant a's short prompts cost few tokens each, so the token-fair queue alone would let it take 3 of
    the 4 running slots in one step; the slot share keeps 2 for b's two requests."""
    engine = CacheEngine(ns_layout(), num_blocks=2000, device="cpu")
    # no contended step bound here: both victims' chunks fit the step, so only the slot share limits them
    sched = Scheduler(engine, token_budget=200, max_batch=4, start_thread=False, contended_budget=0)
    runner = FakeRunner()
    flood = [sched.submit(_req(runner, ns, "a", [(i + 1) % 11, 5, 5, 5], 3)) for i in range(6)]
    victims = [sched.submit(_req(runner, ns, "b", [7, i] * 32, 3, chunk=64)) for i in range(2)]
    sched.step()
    assert all(r.state is State.RUNNING for r in victims)  # 2 of the 4 slots each
    assert sum(r.state is State.RUNNING for r in flood) == 2
    everyone = [*flood, *victims]
    while not all(r.done.is_set() for r in everyone):
        sched.step()
        engine.check_integrity()
    assert [[e.token_id for e in _drain(r) if isinstance(e, TokenOut)] for r in everyone] == \
        [alone(r.prompt, 3) for r in everyone]


def _drain(req: Request) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get())
    return out


def test_the_victims_first_token_comes_within_a_bounded_number_of_steps_under_a_flood(loaded, ns):
    """Real tiny model: 32 flood requests decoding fill most of a small step budget; the victim's 128-token
    prompt (chunks of 32) still gets its first token in 4 steps, and its tokens equal the uncached run."""
    engine = CacheEngine(loaded.layout, num_blocks=1200, device="cpu")
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="fair-llama", revision="r1")
    sched = Scheduler(engine, token_budget=48, max_batch=40, start_thread=False)
    params = SamplingParams(max_tokens=6, stop_at_eos=False)
    flood_params = SamplingParams(max_tokens=60, stop_at_eos=False)
    flood = [sched.submit(_req(gen, ns, "a", _prompt(16, 100 + i), 60, chunk=16, params=flood_params))
             for i in range(32)]
    for _ in range(60):
        sched.step()
        if all(r.prefilled for r in flood):
            break
    assert all(r.prefilled and not r.done.is_set() for r in flood)
    prompt = _prompt(128, 7)
    victim = sched.submit(_req(gen, ns, "b", prompt, 6, chunk=32, params=params))
    steps = 0
    while not victim.prefilled:
        sched.step()
        steps += 1
        assert steps <= 8, "the victim's first token waited behind the flood"
    assert steps <= 4  # ceil(128 / 32): one full chunk a step (without the policy: 16 tokens a step, 8 steps)
    first = sched.snapshot()["tenants"]["b"]  # where its first token's time went, for bench.flood
    assert first["first_tokens"] == 1 and first["queue_steps"] == 0
    assert first["ttft_seconds"] >= first["queue_seconds"] >= 0
    while not victim.done.is_set():
        sched.step()
    solo = CacheEngine(loaded.layout, num_blocks=64, device="cpu")
    solo_gen = CompletionRunner(loaded.model, solo, loaded.tokenizer, model_name="fair-llama", revision="r1")
    expected = solo_gen.complete(ns, prompt, owner="s", params=params, use_cache=False).token_ids
    assert [e.token_id for e in _drain(victim) if isinstance(e, TokenOut)] == expected
    for r in flood:
        sched.cancel(r, wait=False)
    sched.step()
    assert engine.pool.num_in_use == 0


def test_steps_are_bounded_while_two_tenants_contend_and_full_again_when_one_is_left(ns):
    """A request arriving mid-step waits for the step in flight: while another tenant had work within the
    window, the flooder's steps carry at most the contended budget; alone again, the whole budget."""
    engine = CacheEngine(ns_layout(), num_blocks=3000, device="cpu")
    sched = Scheduler(engine, token_budget=256, max_batch=8, contended_budget=64, contended_window=3,
                      start_thread=False)
    runner = Recording()
    flood = [sched.submit(_req(runner, ns, "a", [(i + 3) % 11] * 600, 2, chunk=256)) for i in range(4)]
    sched.step()
    assert sum(e - s for _, s, e in runner.steps[-1]) == 256  # alone: the whole budget
    victim = sched.submit(_req(runner, ns, "b", [200 + i % 50 for i in range(40)], 1))
    while not victim.done.is_set():
        sched.step()
    for _ in range(2):  # b was seen within the window: a's steps stay bounded
        sched.step()
        assert sum(e - s for _, s, e in runner.steps[-1]) <= 64
    for _ in range(3):
        sched.step()
    assert sum(e - s for _, s, e in runner.steps[-1]) == 256  # the window passed: a alone again
    assert sched.counters["contended_steps"] >= 2
    while not all(r.done.is_set() for r in flood):
        sched.step()


def test_recent_tenants_forget_a_tenant_after_the_window():
    recent = RecentTenants(window=3)
    assert recent.note({"a", "b"}, 0) == 2
    assert recent.note({"a"}, 2) == 2
    assert recent.note({"a"}, 3) == 1  # b's last work was 3 steps ago
    assert step_budget(512, recent=2, contended_budget=128) == 128
    assert step_budget(512, recent=1, contended_budget=128) == 512
    assert step_budget(512, recent=2, contended_budget=0) == 512
    with pytest.raises(ValueError):
        RecentTenants(window=0)


def test_share_weights_split_each_step_between_two_flooding_tenants(ns):
    engine = CacheEngine(ns_layout(), num_blocks=3000, device="cpu")
    sched = Scheduler(engine, token_budget=128, max_batch=16, contended_budget=0, start_thread=False)
    sched.set_weight("heavy", 3)
    runner = Recording()
    reqs = [sched.submit(_req(runner, ns, owner, [(i + k) % 11] * 400, 1, chunk=128))
            for k, owner in enumerate(("heavy", "light")) for i in range(6)]
    owner_of = {}
    for _ in range(11):
        sched.step()
        owner_of.update({id(r.seq): r.owner for r in reqs if r.seq is not None})
    served = {"heavy": 0, "light": 0}
    # the first steps spend the credit each tenant banked on arrival (a quantum of tokens, which puts the
    # lighter one further behind in virtual time); then both are backlogged: 3:1 within every step
    for items in runner.steps[6:]:
        for seq, s, e in items:
            served[owner_of[id(seq)]] += e - s
    assert served == {"heavy": 5 * 96, "light": 5 * 32}
    assert sched.counters["lean_steps"] <= 5  # no see-saw of lean steps between two backlogged tenants
    for r in reqs:
        sched.cancel(r, wait=False)
    sched.step()
    assert engine.pool.num_in_use == 0
