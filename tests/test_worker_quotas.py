"""Every quota on every path, against the plain CacheWorker (no Ray): KV API calls hold a concurrency
slot like completions do, a zero quota means zero (never the default), and ``cancel_tenant`` stops a
tenant's running streams at once (suspension, offboarding, key shred)."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from cachecore.errors import InflightLimit, TenantBusy
from tests.worker_calls import complete
from workers.admission import DEFAULT_TENANT_CONCURRENCY, tenant_concurrency
from workers.cache_worker import CacheWorker

BS = 16


@pytest.fixture(scope="module")
def worker():
    return CacheWorker(deployment="quota-llama", preset="tiny", revision={"label": "r1", "seed": 12}, l1_mb=1)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _req(tenant: str, salt: bytes, prompt: list[int], **extra) -> dict:
    return {"tenant": tenant, "scope_salt": salt, "prompt": prompt, "max_tokens": 4,
            "temperature": 0, **extra}


def _kv(tenant: str, salt: bytes, tokens: list[int], **extra) -> dict:
    return {"tenant": tenant, "scope_salt": salt, "tenant_salt": salt, "tokens": tokens, **extra}


def test_an_open_stream_takes_the_tenants_only_slot_from_its_kv_calls(worker):
    salt = secrets.token_bytes(32)
    stream = worker.stream(_req("kv1", salt, _prompt(40, 1), max_tokens=500, max_concurrent_requests=1))
    assert next(stream)["type"] == "prefilled"  # running: it holds the slot
    tokens = _prompt(2 * BS, 2)
    kv = torch.randn(2, *worker.engine.layout.page_shape)
    for call in (lambda: worker.kv_lookup(_kv("kv1", salt, tokens, max_concurrent_requests=1)),
                 lambda: worker.kv_retrieve(_kv("kv1", salt, tokens, max_concurrent_requests=1)),
                 lambda: worker.kv_store(_kv("kv1", salt, tokens, max_concurrent_requests=1), kv)):
        with pytest.raises(TenantBusy):
            call()
    # another tenant is not affected
    assert worker.kv_lookup(_kv("kv-other", salt, tokens, max_concurrent_requests=1))["hit_tokens"] == 0
    stream.close()
    assert worker.kv_lookup(_kv("kv1", salt, tokens, max_concurrent_requests=1))["hit_tokens"] == 0
    worker.check_integrity()


def test_a_kv_call_in_flight_takes_the_slot_from_a_completion(worker, monkeypatch):
    salt = secrets.token_bytes(32)
    entered, release = threading.Event(), threading.Event()
    real = worker.kv_api._tokens

    def blocking(req):  # the KV call is inside its work (its slot taken) until released
        entered.set()
        assert release.wait(30)
        return real(req)

    monkeypatch.setattr(worker.kv_api, "_tokens", blocking)
    t = threading.Thread(target=worker.kv_lookup, args=(_kv("kv2", salt, _prompt(BS, 3), max_concurrent_requests=1),))
    t.start()
    try:
        assert entered.wait(30)
        busy = complete(worker, _req("kv2", salt, _prompt(20, 4), max_concurrent_requests=1))
        assert busy["code"] == "tenant_busy" and busy["retryable"] is True
    finally:
        release.set()
        t.join(30)
    ok = complete(worker, _req("kv2", salt, _prompt(20, 4), max_concurrent_requests=1))
    assert ok["type"] == "finished"  # the slot came back with the KV call's end
    assert worker.counters["tenant_busy"] >= 1


def test_a_zero_concurrency_quota_runs_nothing_and_null_is_the_default(worker):
    assert tenant_concurrency(None) == DEFAULT_TENANT_CONCURRENCY and tenant_concurrency(0) == 0
    salt = secrets.token_bytes(32)
    out = complete(worker, _req("zero", salt, _prompt(20, 5), max_concurrent_requests=0))
    assert out["code"] == "tenant_busy" and "quota is 0" in out["message"]
    with pytest.raises(TenantBusy, match="quota is 0"):
        worker.kv_lookup(_kv("zero", salt, _prompt(BS, 6), max_concurrent_requests=0))
    # null is the default (a quarter of the slots), not zero
    assert complete(worker, _req("zero", salt, _prompt(20, 5), max_concurrent_requests=None))["type"] == "finished"
    assert not worker.engine.running()


def test_a_zero_inflight_quota_admits_nothing_and_null_is_the_default(worker):
    engine = worker.engine
    ns = worker.revisions.active.loaded.namespace(secrets.token_bytes(32))
    engine.set_inflight_limit("nil", 0)
    assert engine.inflight_limit("nil") == 0
    with pytest.raises(InflightLimit):
        engine.admit(ns, _prompt(BS, 7), owner="nil")
    engine.set_inflight_limit("nil", None)
    assert engine.inflight_limit("nil") == engine.default_inflight_blocks
    engine.release(engine.admit(ns, _prompt(BS, 7), owner="nil"))
    engine.check_integrity()


def test_cancel_tenant_ends_its_streams_with_request_stopped_and_no_more_tokens(worker):
    salt = secrets.token_bytes(32)
    victim = [worker.stream(_req("gone", salt, _prompt(40, 10 + i), max_tokens=200, request_id=f"gone-{i}"))
              for i in range(2)]
    waiting_free = worker.stream(_req("gone", salt, _prompt(40, 12), max_tokens=200))  # no request id
    bystander = worker.stream(_req("stays", salt, _prompt(40, 13), max_tokens=40))
    for s in (*victim, waiting_free, bystander):
        assert next(s)["type"] == "prefilled"
        assert next(s)["type"] == "token"
    assert worker.engine.inflight_blocks("gone") > 0

    result = worker.cancel_tenant("gone", reason="tenant suspended")

    assert result == {"cancelled": 3, "remaining": 0}  # every request of the tenant, its blocks released
    assert worker.engine.inflight_blocks("gone") == 0
    for s in (*victim, waiting_free):
        rest = list(s)
        assert [e["type"] for e in rest] == ["error"]  # no token after the cancel
        assert rest[0]["code"] == "request_stopped" and "tenant suspended" in rest[0]["message"]
    tail = list(bystander)  # another tenant's stream runs to its end
    assert tail[-1]["type"] == "finished" and tail[-1]["usage"]["completion_tokens"] == 40
    assert worker.cancel_tenant("gone") == {"cancelled": 0, "remaining": 0}  # idempotent
    assert complete(worker, _req("gone", salt, _prompt(20, 14)))["type"] == "finished"  # later requests run
    worker.check_integrity()
