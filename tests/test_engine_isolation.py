"""Paired isolation tests at the engine level: what shares a namespace reuses, what does not misses."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.errors import InvalidPrompt, OutOfBlocks, PromptTooLong, UnknownNamespaceField
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.namespace import Namespace
from cachecore.runner import CompletionRunner, SamplingParams

BS = 16
PROMPT = list(range(40, 40 + 70))


@pytest.fixture(scope="module")
def loaded():
    return load_model("iso-llama", "tiny", RevisionSpec(label="r1", seed=11), device="cpu")


@pytest.fixture
def gen(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=128, device="cpu")
    return CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="iso-llama", revision="r1")


def _hit(gen, ns, tokens=PROMPT, owner="a", salt=b""):
    _, hit = gen.prefill_logits(ns, tokens, owner=owner, request_salt=salt)
    gen.engine.check_integrity()
    return hit


def _fields(loaded, **override):
    base = dict(
        scope_salt=b"\x01" * 32, model_id=loaded.name, weight_digest=loaded.weight_digest,
        tokenizer_digest=loaded.chat.digest, layout=loaded.layout.canonical(), rope=loaded.config.rope_canonical(),
    )
    base.update(override)
    return Namespace.build(**base)


def test_same_tenant_reuses_and_other_tenant_salt_does_not(loaded, gen):
    a, b = loaded.namespace(secrets.token_bytes(32)), loaded.namespace(secrets.token_bytes(32))
    assert _hit(gen, a) == 0
    assert _hit(gen, a) == 64
    assert _hit(gen, b, owner="b") == 0


@pytest.mark.parametrize("field,value", [
    ("weight_digest", "another-revision-digest"),
    ("tokenizer_digest", "another-tokenizer"),
    ("layout", {"dtype": "float16", "block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}),
    ("lora_id", "adapter-7"),
    ("rope", {"kind": "rope", "style": "half", "theta": 500000.0, "dim": 16}),
    ("model_id", "other-model"),
])
def test_any_namespace_field_change_misses(loaded, gen, field, value):
    base = _fields(loaded)
    assert _hit(gen, base) == 0
    assert _hit(gen, base) == 64  # paired: the unchanged namespace does reuse
    assert _hit(gen, _fields(loaded, **{field: value})) == 0


def test_request_salt_narrows_within_a_tenant(loaded, gen):
    ns = loaded.namespace(secrets.token_bytes(32))
    assert _hit(gen, ns, salt=b"user-1") == 0
    assert _hit(gen, ns, salt=b"user-1") == 64
    assert _hit(gen, ns, salt=b"user-2") == 0
    assert _hit(gen, ns) == 0  # no salt does not see the salted entries either


def test_forced_hash_collision_is_caught_by_token_recheck(loaded, gen):
    ns = loaded.namespace(secrets.token_bytes(32))
    other = [t + 1 for t in PROMPT]
    _hit(gen, ns, tokens=other)
    # Make the index answer PROMPT's first block hash with the block that holds `other`'s tokens.
    from cachecore.hashing import chain_hashes

    victim = chain_hashes(ns, other, BS)[0]
    forged = chain_hashes(ns, PROMPT, BS)[0]
    pool = gen.engine.pool
    pool._index[forged] = pool._index[victim]
    before = pool.stats.collisions
    assert pool.get_cached(forged, tuple(PROMPT[:BS])) is None
    assert pool.stats.collisions == before + 1
    del pool._index[forged]
    assert _hit(gen, ns) == 0
    logits, _ = gen.prefill_logits(ns, PROMPT, owner="a")
    torch.testing.assert_close(logits, loaded.model.forward_dense(torch.tensor(PROMPT))[-1].float(),
                               atol=1e-5, rtol=1e-5)


def test_bad_input_raises_typed_errors(loaded, gen):
    ns = loaded.namespace(secrets.token_bytes(32))
    p = SamplingParams(max_tokens=1)
    with pytest.raises(InvalidPrompt):
        gen.complete(ns, [], owner="a", params=p)
    with pytest.raises(InvalidPrompt):
        gen.complete(ns, [1, 2, loaded.config.vocab_size], owner="a", params=p)
    with pytest.raises(InvalidPrompt):
        gen.complete(ns, [1, 2.5, 3], owner="a", params=p)
    with pytest.raises(InvalidPrompt):
        gen.complete(ns, [1, True], owner="a", params=p)
    with pytest.raises(InvalidPrompt):
        gen.complete(ns, "text", owner="a", params=p)
    with pytest.raises(PromptTooLong):
        gen.complete(ns, [1] * loaded.config.max_seq_len, owner="a", params=p)
    with pytest.raises(UnknownNamespaceField):
        Namespace.build(**{**dict(scope_salt=b"\x00" * 32, model_id="m", weight_digest="w", tokenizer_digest="t",
                                  layout={}, rope={}), "colour": "blue"})
    gen.engine.check_integrity()
    assert gen.engine.pool.num_in_use == 0  # nothing leaked by the failures


def test_tenant_flood_under_cap_cannot_evict_other_tenants_hot_prefix(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=48, device="cpu")
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="iso-llama", revision="r1")
    victim, attacker = loaded.namespace(secrets.token_bytes(32)), loaded.namespace(secrets.token_bytes(32))
    hot = list(range(100, 100 + 65))  # 4 full blocks usable
    assert _hit(gen, victim, tokens=hot, owner="victim") == 0
    engine.set_tenant_cap("attacker", 16 * BS)
    for i in range(40):  # 40 distinct 4-block prompts: far more than the pool holds
        flood = [(i * 7 + j) % 256 for j in range(65)]
        _hit(gen, attacker, tokens=flood, owner="attacker")
        assert engine.pool.cached_tokens("attacker") <= 16 * BS
    assert _hit(gen, victim, tokens=hot, owner="victim") == 64


def test_out_of_blocks_is_typed_and_leaks_nothing(loaded):
    engine = CacheEngine(loaded.layout, num_blocks=4, device="cpu")
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="iso-llama", revision="r1")
    ns = loaded.namespace(secrets.token_bytes(32))
    with pytest.raises(OutOfBlocks):
        gen.complete(ns, list(range(100)), owner="a", params=SamplingParams(max_tokens=1))
    engine.check_integrity()
    assert engine.pool.num_in_use == 0


def test_concurrent_streams_share_prefix_and_keep_pool_intact(loaded, gen):
    ns = loaded.namespace(secrets.token_bytes(32))
    expected = gen.complete(ns, PROMPT, owner="a", params=SamplingParams(max_tokens=8), use_cache=False).token_ids
    results, errors = [], []

    def worker():
        try:
            results.append(gen.complete(ns, PROMPT, owner="a", params=SamplingParams(max_tokens=8)).token_ids)
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [expected] * 6
    gen.engine.check_integrity()
    assert gen.engine.pool.num_in_use == 0


def test_flush_drops_only_matching_blocks_and_running_request_stays_exact(loaded, gen):
    a, b = loaded.namespace(secrets.token_bytes(32)), loaded.namespace(secrets.token_bytes(32))
    _hit(gen, a, owner="a")
    _hit(gen, b, owner="b")
    freed = gen.engine.flush(lambda tag: tag.owner == "a")
    assert freed["blocks_freed"] > 0
    assert _hit(gen, a, owner="a") == 0
    assert _hit(gen, b, owner="b") == 64


def test_metrics_are_token_weighted(loaded, gen):
    ns = loaded.namespace(secrets.token_bytes(32))
    _hit(gen, ns)
    _hit(gen, ns)
    snap = gen.engine.snapshot()
    row = next(r for r in snap["usage"] if r["tenant"] == "a")
    assert row["query_tokens"] == 2 * len(PROMPT)
    assert row["effective_hit_tokens"] == 64
    assert row["effective_hit_ratio"] == pytest.approx(64 / (2 * len(PROMPT)), abs=1e-3)
    assert snap["pool"]["total"] == 128
    assert snap["pool"]["protected"] + snap["pool"]["evictable"] + snap["pool"]["free"] == 128
