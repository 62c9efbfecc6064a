"""The plain CacheWorker (no Ray) under attack: KV transplant, NaN uploads, in-flight and concurrency
bounds, cancellation, and test hooks that production workers refuse."""

from __future__ import annotations

import secrets

import pytest
import torch

from cachecore.errors import InflightLimit, InvalidKV
from tests.worker_calls import complete
from workers.cache_worker import CacheWorker

BS = 16


@pytest.fixture(scope="module")
def worker():
    return CacheWorker(deployment="iso-llama", preset="tiny", revision={"label": "r1", "seed": 11}, l1_mb=1,
                       test_hooks=True)


def _req(tenant: str, salt: bytes, prompt: list[int], **extra) -> dict:
    return {"tenant": tenant, "scope_salt": salt, "prompt": prompt, "max_tokens": 4,
            "temperature": 0, **extra}


def _run(worker, req) -> dict:
    out = complete(worker, req)
    worker.check_integrity()
    return out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_uploaded_kv_never_changes_a_completion(worker):
    salt = secrets.token_bytes(32)
    real, forged = _prompt(80, 1), _prompt(80, 2)
    cold = _run(worker, _req("t1", salt, real, use_cache=False))
    # The attacker computes the KV of the forged prompt and uploads it under the real prompt's tokens.
    _run(worker, _req("t1", salt, forged))
    forged_kv, _, _ = worker.kv_retrieve({"tenant": "t1", "scope_salt": salt, "tenant_salt": salt, "tokens": forged})
    assert forged_kv.shape[0] >= 4
    stored = worker.kv_store({"tenant": "t1", "scope_salt": salt, "tenant_salt": salt, "tokens": real[:64]},
                             forged_kv[:4].contiguous())
    assert stored == 4
    # The KV API reads the upload back (paired: the store really happened) ...
    found = worker.kv_lookup({"tenant": "t1", "scope_salt": salt, "tenant_salt": salt, "tokens": real[:64]})
    assert found == {"hit_tokens": 64, "origin": "upload"}
    # ... but the completion of the real prompt neither hits it nor answers like the forged prompt.
    out = _run(worker, _req("t1", salt, real))
    assert out["usage"]["cached_tokens"] == 0
    assert out["token_ids"] == cold["token_ids"]


def test_share_group_member_upload_is_invisible_to_other_members(worker):
    group, own_a, own_b = secrets.token_bytes(32), secrets.token_bytes(32), secrets.token_bytes(32)
    tokens = _prompt(48, 3)
    kv = torch.randn(3, *worker.engine.layout.page_shape)
    worker.kv_store({"tenant": "a", "scope_salt": group, "tenant_salt": own_a, "tokens": tokens}, kv)
    mine = worker.kv_lookup({"tenant": "a", "scope_salt": group, "tenant_salt": own_a, "tokens": tokens})
    theirs = worker.kv_lookup({"tenant": "b", "scope_salt": group, "tenant_salt": own_b, "tokens": tokens})
    assert mine["hit_tokens"] == 48 and theirs["hit_tokens"] == 0
    out = _run(worker, _req("b", group, tokens + [5]))
    assert out["usage"]["cached_tokens"] == 0
    # Model-computed KV is still shared inside the group (paired): a third member sees what b computed.
    assert worker.kv_lookup({"tenant": "c", "scope_salt": group, "tenant_salt": secrets.token_bytes(32),
                             "tokens": tokens}) == {"hit_tokens": 48, "origin": "model"}


@pytest.mark.parametrize("bad", ["nan", "inf", "shape", "dtype"])
def test_invalid_uploads_are_refused_before_touching_the_pages(worker, bad):
    salt = secrets.token_bytes(32)
    tokens = _prompt(32, 4)
    kv = torch.randn(2, *worker.engine.layout.page_shape)
    if bad == "nan":
        kv[1, 0, 0, 3] = float("nan")
    elif bad == "inf":
        kv[0, 1, 0, 0] = float("inf")
    elif bad == "shape":
        kv = kv[:, :, :, :8]
    else:
        kv = kv.double()
    before = worker.engine.pool.num_cached
    with pytest.raises(InvalidKV):
        worker.kv_store({"tenant": "t", "scope_salt": salt, "tenant_salt": salt, "tokens": tokens}, kv)
    assert worker.engine.pool.num_cached == before
    worker.check_integrity()


def test_kv_token_lists_are_bounded_by_context_length_and_vocabulary(worker):
    salt = secrets.token_bytes(32)
    base = {"tenant": "t", "scope_salt": salt, "tenant_salt": salt}
    with pytest.raises(InvalidKV):
        worker.kv_lookup({**base, "tokens": [1] * 5000})
    with pytest.raises(InvalidKV):
        worker.kv_lookup({**base, "tokens": [2**32]})
    assert worker.kv_lookup({**base, "tokens": [1] * 32}) == {"hit_tokens": 0, "origin": None}


def test_inflight_limit_bounds_one_tenants_running_requests(worker):
    engine = worker.engine
    salt = secrets.token_bytes(32)
    ns = worker.revisions.active.loaded.namespace(salt)
    limit = engine.inflight_limit("hog")
    assert limit == engine.pool.num_blocks // 2  # the default, with no operator setting
    seqs = [engine.admit(ns, _prompt(BS * 8, 10 + i), owner="hog") for i in range(limit // 8)]
    with pytest.raises(InflightLimit) as err:
        engine.admit(ns, _prompt(BS * 8, 99), owner="hog")
    assert not any(ch.isdigit() for ch in str(err.value))
    other = engine.admit(ns, _prompt(BS * 8, 100), owner="other")  # another tenant is unaffected
    engine.check_integrity()
    for seq in [*seqs, other]:
        engine.release(seq)
    engine.set_inflight_limit("hog", BS * 8)
    one = engine.admit(ns, _prompt(BS * 8, 101), owner="hog")
    with pytest.raises(InflightLimit):
        engine.admit(ns, _prompt(BS, 102), owner="hog")
    engine.release(one)
    engine.set_inflight_limit("hog", None)
    engine.check_integrity()


def test_cancel_stops_a_stream_and_frees_its_blocks(worker):
    salt = secrets.token_bytes(32)
    events = worker.stream(_req("c", salt, _prompt(40, 5), max_tokens=500, request_id="req-1"))
    assert next(events)["type"] == "prefilled"
    assert next(events)["type"] == "token"
    assert worker.engine.inflight_blocks("c") > 0
    assert worker.cancel("req-1") is True
    rest = list(events)
    assert rest[-1]["type"] == "error" and rest[-1]["code"] == "cancelled"
    assert len(rest) < 5  # it stopped at the next token, not after 500
    assert worker.engine.inflight_blocks("c") == 0 and not worker.engine.running()
    worker.check_integrity()
    assert worker.cancel("not-running") is False


def test_a_tenant_over_its_concurrency_gets_tenant_busy_and_others_do_not(worker):
    salt = secrets.token_bytes(32)
    streams = [worker.stream(_req("busy", salt, _prompt(20, 20 + i), max_tokens=50, max_concurrent_requests=2))
               for i in range(2)]
    firsts = [next(s) for s in streams]  # both running, holding their slot
    assert all(f["type"] == "prefilled" for f in firsts)
    third = _run(worker, _req("busy", salt, _prompt(20, 30), max_concurrent_requests=2))
    assert third["code"] == "tenant_busy" and third["retryable"] is True
    other = _run(worker, _req("calm", salt, _prompt(20, 31), max_concurrent_requests=2))
    assert other["finish_reason"] in ("length", "stop")
    for s in streams:
        s.close()
    assert _run(worker, _req("busy", salt, _prompt(20, 32), max_concurrent_requests=2))["type"] == "finished"
    worker.check_integrity()


def test_test_hooks_are_refused_on_production_workers(worker):
    assert worker.poison_free_blocks() >= 0
    prod = CacheWorker(deployment="prod-llama", preset="tiny", revision={"label": "r1", "seed": 1}, l1_mb=1)
    with pytest.raises(PermissionError):
        prod.poison_free_blocks()


@pytest.mark.parametrize("weight", [3, None])
def test_a_tenants_share_weight_protects_more_of_its_cache_from_another_tenants_flood(weight):
    """``share_weight`` (a tenant quota, in every worker request) weights the fair share of the pool:
    with 3 against 1, tenant A keeps 80 of 128 blocks through B's flood (its share is 96); with equal
    weights its share is 64 and the flood takes it down to that."""
    worker = CacheWorker(deployment="weights-llama", preset="tiny", revision={"label": "r1", "seed": 11},
                         l1_mb=1, l2_mb=0)
    assert worker.engine.pool.num_blocks == 128
    a, b = secrets.token_bytes(32), secrets.token_bytes(32)
    a_prompts = [_prompt(160, 100 + i) for i in range(8)]  # 10 full blocks each: 80 blocks
    for p in a_prompts:
        _run(worker, _req("A", a, p, share_weight=weight))
    for i in range(20):
        _run(worker, _req("B", b, _prompt(160, 500 + i)))
    held = sum(worker.kv_lookup({"tenant": "A", "scope_salt": a, "tenant_salt": a, "tokens": p})["hit_tokens"]
               for p in a_prompts) // BS
    if weight == 3:
        assert held == 80
    else:
        assert 60 <= held <= 64
