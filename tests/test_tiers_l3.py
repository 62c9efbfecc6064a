"""The engine over L1 + L2 + the encrypted L3: exactness from L3, restarts, sharing between workers,
persistence rules, flushes and shredding, and a slow backend that must mean recompute."""

from __future__ import annotations

import secrets
import time

import pytest
import torch

from cachecore import crypto
from cachecore.config import EngineConfig
from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams
from cachecore.tiers.backends import open_backend
from cachecore.tiers.remote import RemoteStore

BS, CHUNK = 16, 4  # 4-block (64-token) chunks keep the prompts short


@pytest.fixture(scope="module")
def loaded():
    return load_model("l3-llama", "tiny", RevisionSpec(label="r1", seed=6), device="cpu")


@pytest.fixture
def keys():
    ring = crypto.Keyring()
    ring.add("t", 1, crypto.generate_key())
    return ring


def _gen(loaded, root, keys, *, l1=24, l2=0, **cfg) -> CompletionRunner:
    store = RemoteStore(open_backend(root.as_uri()), keys, loaded.layout, chunk_blocks=CHUNK)
    engine = CacheEngine(loaded.layout, num_blocks=l1, device="cpu", config=EngineConfig(l2_blocks=l2, **cfg), l3=store)
    return CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="l3-llama", revision="r1")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _dense_last(loaded, tokens):
    with torch.inference_mode():
        return loaded.model.forward_dense(torch.tensor(tokens))[-1].float()


@pytest.mark.parametrize("length", [65, 100, 129, 200])
def test_a_restarted_engine_serves_the_prefix_from_l3_exactly(loaded, tmp_path, keys, length):
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(length, length)
    first = _gen(loaded, tmp_path, keys)
    cold = first.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=8), use_cache=False)
    first.prefill_logits(ns, tokens, owner="t")
    first.engine.drain_writes()
    restarted = _gen(loaded, tmp_path, keys)  # a new process: empty L1, the same directory and keys
    logits, hit = restarted.prefill_logits(ns, tokens, owner="t")
    assert hit == (length - 1) // (BS * CHUNK) * BS * CHUNK > 0
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    again = _gen(loaded, tmp_path, keys)
    warm = again.complete(ns, tokens, owner="t", params=SamplingParams(max_tokens=8))
    assert warm.cached_tokens == hit and warm.token_ids == cold.token_ids
    assert again.engine.metrics.tier("l3").promotions >= hit // BS
    restarted.engine.check_integrity()


def test_two_engines_sharing_a_directory_see_each_others_chunks(loaded, tmp_path, keys):
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(140, 1)
    a, b = _gen(loaded, tmp_path, keys), _gen(loaded, tmp_path, keys)
    a.prefill_logits(ns, tokens, owner="t")
    a.engine.drain_writes()
    assert b.prefill_logits(ns, tokens, owner="t")[1] == 128


def test_no_persistence_means_nothing_reaches_l3(loaded, tmp_path, keys):
    ns = loaded.namespace(secrets.token_bytes(32))
    gen = _gen(loaded, tmp_path, keys)
    params = SamplingParams(max_tokens=1)
    list(gen.stream(ns, _prompt(140, 2), owner="t", params=params, persist=False))
    list(gen.stream(ns, _prompt(140, 3), owner="nokey", params=params))  # a tenant without a data key
    gen.engine.drain_writes()
    assert gen.engine.l3.count_scope()[0] == 0
    list(gen.stream(ns, _prompt(140, 4), owner="t", params=params))  # paired: this one is written
    gen.engine.drain_writes()
    assert gen.engine.l3.count_scope(tenant="t")[0] == 2


def test_a_flush_and_a_shredded_key_leave_nothing_readable(loaded, tmp_path, keys):
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(140, 5)
    gen = _gen(loaded, tmp_path, keys)
    gen.prefill_logits(ns, tokens, owner="t")
    gen.engine.drain_writes()
    result = gen.engine.flush(lambda t: t.owner == "t", l3_scope={"tenant": "t"})
    assert result["tiers"]["l3"] == 2 and result["l3_bytes"] > 0
    assert gen.engine.count_cached(lambda t: t.owner == "t", l3_scope={"tenant": "t"}) == 0
    assert _gen(loaded, tmp_path, keys).prefill_logits(ns, tokens, owner="t")[1] == 0
    gen2 = _gen(loaded, tmp_path, keys)
    gen2.prefill_logits(ns, tokens, owner="t")
    gen2.engine.drain_writes()
    keys.drop("t", 1)  # crypto-shred: the bytes are still there, nothing can read them
    assert gen2.engine.l3.count_scope(tenant="t")[0] == 2
    assert _gen(loaded, tmp_path, keys).prefill_logits(ns, tokens, owner="t")[1] == 0


def test_a_slow_l3_backend_means_recompute_within_the_deadline(loaded, tmp_path, keys, monkeypatch):
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(140, 6)
    gen = _gen(loaded, tmp_path, keys)
    gen.prefill_logits(ns, tokens, owner="t")
    gen.engine.drain_writes()
    slow = _gen(loaded, tmp_path, keys, load_deadline_s=0.1)
    real_get = slow.engine.l3.backend.get_into

    def crawl(name, out):
        time.sleep(1.0)
        return real_get(name, out)

    monkeypatch.setattr(slow.engine.l3.backend, "get_into", crawl)
    t0 = time.perf_counter()
    logits, hit = slow.prefill_logits(ns, tokens, owner="t")
    assert hit == 0 and time.perf_counter() - t0 < 0.9  # did not wait for the backend
    torch.testing.assert_close(logits, _dense_last(loaded, tokens), atol=1e-5, rtol=1e-5)
    slow.engine.check_integrity()


def test_expired_objects_are_never_served(loaded, tmp_path, keys):
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(140, 7)
    gen = _gen(loaded, tmp_path, keys)
    gen.prefill_logits(ns, tokens, owner="t")
    gen.engine.drain_writes()
    later = _gen(loaded, tmp_path, keys)
    later.engine.l3.clock = lambda: time.time() + 3600
    seq = later.engine.admit(ns, tokens, owner="t", model="l3-llama", revision="r1", retention_seconds=60)
    assert later.engine.finish_loads(seq) == 0
    later.engine.release(seq)
    seq = later.engine.admit(ns, tokens, owner="t", model="l3-llama", revision="r1",
                               retention_seconds=86400)  # paired: within retention
    assert later.engine.finish_loads(seq) == 128
    later.engine.abort(seq)


def test_chunks_loaded_from_l3_are_promoted_into_l2_as_well(loaded, tmp_path, keys):
    ns = loaded.namespace(secrets.token_bytes(32))
    tokens = _prompt(140, 8)
    writer = _gen(loaded, tmp_path, keys)
    writer.prefill_logits(ns, tokens, owner="t")
    writer.engine.drain_writes()
    reader = _gen(loaded, tmp_path, keys, l2=32)
    assert reader.prefill_logits(ns, tokens, owner="t")[1] == 128
    assert reader.engine.l2.count(lambda t: t.owner == "t") == 8  # both chunks, block by block
    reader.engine.check_integrity()
