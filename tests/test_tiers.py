"""The tier hierarchy: L2 (host memory) under L1, write policies, load-vs-recompute, faults, flushes.

Exactness first: with the prefix served from L2 (after eviction from L1 and promotion back), logits
equal ``forward_dense`` and greedy outputs are identical token for token.
"""

from __future__ import annotations

import secrets
import time

import pytest
import torch

from cachecore.config import EngineConfig
from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("tier-llama", "tiny", RevisionSpec(label="r1", seed=4), device="cpu")


def _gen(loaded, *, l1=12, l2=64, **cfg) -> CompletionRunner:
    engine = CacheEngine(loaded.layout, num_blocks=l1, device="cpu", config=EngineConfig(l2_blocks=l2, **cfg))
    return CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="tier-llama", revision="r1")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _dense_last(loaded, tokens):
    with torch.inference_mode():
        return loaded.model.forward_dense(torch.tensor(tokens))[-1].float()


def _evict_l1(gen: CompletionRunner, ns, owner: str = "t", seed: int = 999) -> None:
    """Fill L1 with other prompts of the same owner so every earlier block leaves L1 (for L2)."""
    for i in range(3):
        gen.prefill_logits(ns, _prompt(BS * (gen.engine.pool.num_blocks - 1), seed + i), owner=owner)


@pytest.mark.parametrize("length", [5, 16, 17, 33, 48, 63, 100])
def test_logits_with_the_prefix_from_l2_equal_from_scratch(loaded, length):
    gen = _gen(loaded)
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(length, length)
    gen.prefill_logits(ns, tokens, owner="t")
    _evict_l1(gen, ns)
    logits, hit = gen.prefill_logits(ns, tokens, owner="t")
    assert hit == (length - 1) // BS * BS
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    assert gen.engine.metrics.tier("l2").promotions >= hit // BS
    assert gen.engine.metrics.tier("l2").demotions > 0  # the filler traffic went down to L2
    gen.engine.check_integrity()


def test_greedy_output_and_multi_turn_chat_are_identical_through_l2(loaded):
    gen = _gen(loaded, l1=14)
    ns = loaded.namespace(secrets.token_bytes(32))
    params = SamplingParams(max_tokens=20)
    turn1 = _prompt(70, 1)
    cold = gen.complete(ns, turn1, owner="t", params=params, use_cache=False)
    first = gen.complete(ns, turn1, owner="t", params=params)
    _evict_l1(gen, ns)
    warm = gen.complete(ns, turn1, owner="t", params=params)
    assert warm.cached_tokens == 64 and cold.token_ids == first.token_ids == warm.token_ids
    turn2 = turn1 + warm.token_ids + _prompt(12, 2)  # the next turn reuses turn 1 and its answer
    _evict_l1(gen, ns)
    cold2 = gen.complete(ns, turn2, owner="t", params=params, use_cache=False)
    warm2 = gen.complete(ns, turn2, owner="t", params=params)
    assert warm2.cached_tokens >= 80 and warm2.token_ids == cold2.token_ids
    gen.engine.check_integrity()


def test_a_corrupt_l2_block_is_a_miss_from_there_never_wrong_bytes(loaded):
    gen = _gen(loaded)
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(80, 7)
    gen.prefill_logits(ns, tokens, owner="t")
    _evict_l1(gen, ns)
    seq_hashes = gen.engine.admit(ns, tokens, owner="probe", use_cache=True)  # read the chain
    keys = seq_hashes.hashes
    gen.engine.release(seq_hashes)
    _evict_l1(gen, ns, seed=500)
    assert gen.engine.l2.corrupt(keys[2])
    logits, hit = gen.prefill_logits(ns, tokens, owner="t")
    assert hit == 2 * BS  # blocks 0 and 1 arrived; 2 was corrupt, so 2.. are recomputed
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    tier = gen.engine.metrics.tier("l2")
    assert tier.corrupt_loads == 1 and tier.fallbacks_to_recompute >= 1
    assert not gen.engine.l2.contains(keys[2], tuple(tokens[32:48]))  # quarantined (dropped)
    gen.engine.check_integrity()


def test_a_late_load_falls_back_to_recompute_and_is_counted(loaded, monkeypatch):
    gen = _gen(loaded, load_deadline_s=0.05)
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(64, 8)
    gen.prefill_logits(ns, tokens, owner="t")
    _evict_l1(gen, ns)
    real_get = gen.engine.l2.get

    def slow_get(items):
        time.sleep(0.3)
        return real_get(items)

    monkeypatch.setattr(gen.engine.l2, "get", slow_get)
    logits, hit = gen.prefill_logits(ns, tokens, owner="t")
    assert hit == 0
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    assert gen.engine.metrics.tier("l2").failures == 1
    time.sleep(0.5)
    assert gen.engine.metrics.tier("l2").late_loads == 1
    usage = gen.engine.metrics.usage("t", "tier-llama")
    assert usage.load_success_tokens > usage.effective_hit_tokens  # bytes arrived, prefill not skipped
    gen.engine.check_integrity()


def test_always_recompute_never_loads_and_cost_policy_loads_a_cheap_prefix(loaded):
    for policy, expect_hit in (("always_recompute", 0), ("cost", 48), ("always_load", 48)):
        gen = _gen(loaded, load_policy=policy)
        ns = loaded.namespace(secrets.token_bytes(32))
        tokens = _prompt(50, 9)
        gen.prefill_logits(ns, tokens, owner="t")
        _evict_l1(gen, ns)
        assert gen.prefill_logits(ns, tokens, owner="t")[1] == expect_hit, policy
        assert gen.engine.cost.decisions["recompute" if expect_hit == 0 else "load"] >= 1


def test_flush_and_retire_reach_l2_and_report_per_tier(loaded):
    gen = _gen(loaded)
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(64, 10)
    gen.prefill_logits(ns, tokens, owner="a")
    _evict_l1(gen, ns, owner="a")
    assert gen.engine.l2.count(lambda t: t.owner == "a") > 0
    result = gen.engine.flush(lambda t: t.owner == "a")
    assert result["tiers"]["l2"] > 0 and result["blocks_freed"] == result["tiers"]["l1"] + result["tiers"]["l2"]
    assert gen.engine.count_cached(lambda t: t.owner == "a") == 0
    assert gen.prefill_logits(ns, tokens, owner="a")[1] == 0
    _evict_l1(gen, ns, owner="a")
    assert gen.engine.retire("tier-llama", "r1")["tiers"]["l2"] > 0
    assert gen.engine.l2.count(lambda t: True) == 0
    gen.engine.check_integrity()


def test_write_through_copies_after_commit_and_selective_keeps_only_reused_blocks(loaded):
    gen = _gen(loaded, write_policy="write_through")
    ns = loaded.namespace(secrets.token_bytes(32))
    gen.prefill_logits(ns, _prompt(64, 11), owner="t")
    gen.engine.drain_writes()
    assert gen.engine.l2.count(lambda t: True) == 4  # every committed block, without any eviction
    gen.engine.check_integrity()

    sel = _gen(loaded, write_policy="selective", selective_min_hits=1)
    ns = loaded.namespace(secrets.token_bytes(32))
    reused, once = _prompt(33, 12), _prompt(33, 13)
    sel.prefill_logits(ns, reused, owner="t")
    sel.prefill_logits(ns, reused, owner="t")  # a hit: its blocks were reused once
    sel.prefill_logits(ns, once, owner="t")
    _evict_l1(sel, ns)
    assert sel.prefill_logits(ns, reused, owner="t")[1] == 32
    assert sel.prefill_logits(ns, once, owner="t")[1] == 0


def test_a_flush_of_one_tenant_does_not_stop_another_tenants_inflight_request_from_caching(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=32, device="cpu")
    ns = loaded.namespace(secrets.token_bytes(32))
    a = engine.admit(ns, _prompt(40, 14), owner="a")
    b = engine.admit(ns, _prompt(40, 15), owner="b")
    engine.flush(lambda t: t.owner == "a")
    for seq in (a, b):
        engine.mark_computed(seq, len(seq.tokens))
    assert engine.commit(a) == 0  # admitted before a flush that matches it: stays flushed
    assert engine.commit(b) == 2  # another tenant keeps caching
    engine.release(a)
    engine.release(b)
    assert engine.fence.pending() == 0  # nothing admitted before the flush is alive any more
    engine.check_integrity()


def test_freed_and_demoted_pages_are_never_read(loaded):
    gen = _gen(loaded)
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(90, 16)
    expected = gen.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=10), use_cache=False).token_ids
    gen.prefill_logits(ns, tokens, owner="t")
    _evict_l1(gen, ns)
    with gen.engine._lock:
        ids = [b.block_id for b in gen.engine.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
        gen.engine.pages.poison(torch.tensor(ids, dtype=torch.long))
    out = gen.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=10))
    assert out.cached_tokens == 80 and out.token_ids == expected
    gen.engine.check_integrity()


def test_engine_config_is_validated_when_built():
    for bad in ({"l2_blocks": -1}, {"write_policy": "sometimes"}, {"load_policy": "maybe"},
                {"load_deadline_s": 0}, {"selective_min_hits": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_a_probe_after_a_flush_counts_what_the_flush_left_not_the_tenants_later_traffic(loaded):
    """The flush job's verification runs while the tenant keeps sending requests: blocks its requests
    cache after the flush (L1 and, evicted, L2) are not leftovers; blocks admitted before it are."""
    from workers.operations import Operations

    gen = _gen(loaded)
    ops = Operations(gen.engine, l3=None, deployment="tier-llama")
    ns = loaded.namespace(secrets.token_bytes(32))
    gen.prefill_logits(ns, _prompt(64, 20), owner="7")
    flushed = ops.flush({"scope": "tenant", "tenant": "7"})
    since = flushed["since"]
    assert since["instance"] == ops.instance and since["generation"] >= 1
    gen.prefill_logits(ns, _prompt(64, 21), owner="7")  # the tenant's traffic right after the flush
    _evict_l1(gen, ns, owner="7")
    assert ops.probe({"scope": "tenant", "tenant": "7"})["ok"] is False  # counts everything it holds
    assert ops.probe({"scope": "tenant", "tenant": "7", "since": since}) == {"remaining_blocks": 0, "ok": True}
    # A block cached before the flush that survived it would count (here: the flush's generation is
    # newer than everything cached: a probe against a later generation sees the tenant's blocks).
    later = {**since, "generation": since["generation"] + 1}
    assert ops.probe({"scope": "tenant", "tenant": "7", "since": later})["ok"] is False
    # Another engine (the replica restarted after the flush) holds nothing from before it.
    assert ops.probe({"scope": "tenant", "tenant": "7", "since": {**later, "instance": "other"}})["ok"] is True
