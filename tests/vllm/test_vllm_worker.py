"""VllmWorker against a real vLLM engine (CPU build, in-process): scopes through ``cache_salt``,
exactness with and without a prefix hit, flushes, cancellation, quotas, figures and KV events."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

from cachecore.routing.hashes import request_hashes, request_salt
from tests.worker_calls import complete

A, B = secrets.token_bytes(32), secrets.token_bytes(32)
PROMPT = list(range(3, 140))  # 137 tokens: 4 full blocks of 32 are reusable


def _req(salt: bytes, prompt=PROMPT, tenant: str | None = None, **kw) -> dict:
    return {"tenant": tenant or ("1" if salt == A else "2"), "scope_salt": salt, "prompt": list(prompt),
            "max_tokens": kw.pop("max_tokens", 4), **kw}


def _cached(worker, salt, prompt=PROMPT, **kw) -> int:
    events = worker.collect(_req(salt, prompt, **kw))
    assert events[-1]["type"] == "finished", events[-1]
    return events[0]["cached_tokens"]


def test_a_scope_reuses_its_own_prefix_and_never_another_scope_s(vllm_worker):
    prompt = [p + 1 for p in PROMPT]
    assert _cached(vllm_worker, A, prompt) == 0
    assert _cached(vllm_worker, A, prompt) == (len(prompt) - 1) // 32 * 32  # the usable bound
    assert _cached(vllm_worker, B, prompt) == 0  # the same tokens under another tenant's salt
    assert _cached(vllm_worker, B, prompt) > 0


def test_client_cache_salt_only_narrows(vllm_worker):
    prompt = [p + 2 for p in PROMPT]
    assert _cached(vllm_worker, A, prompt, cache_salt="user-1") == 0
    assert _cached(vllm_worker, A, prompt, cache_salt="user-1") > 0
    assert _cached(vllm_worker, A, prompt, cache_salt="user-2") == 0
    assert _cached(vllm_worker, A, prompt) == 0  # no salt is a scope of its own too
    # B naming the very salt A used reaches nothing of A's
    assert _cached(vllm_worker, B, prompt, cache_salt="user-1") == 0


@pytest.mark.parametrize("length", [31, 32, 33, 64, 65])
def test_greedy_output_is_identical_cold_and_with_a_prefix_hit_around_block_boundaries(vllm_worker, vllm_checkpoint,
                                                                                      length):
    hf = vllm_checkpoint[1]
    prompt = [5 + (i * 7) % 300 for i in range(length)]
    salt = secrets.token_bytes(32)
    cold = complete(vllm_worker, _req(salt, prompt, tenant="9", max_tokens=8))
    warm = complete(vllm_worker, _req(salt, prompt, tenant="9", max_tokens=8))
    assert warm["usage"]["cached_tokens"] == (length - 1) // 32 * 32
    assert warm["token_ids"] == cold["token_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    ref_ids = ref[0, length:].tolist()
    assert cold["token_ids"] == ref_ids[:len(cold["token_ids"])]


def test_use_cache_false_neither_reads_nor_writes(vllm_worker):
    prompt = [p + 3 for p in PROMPT]
    assert _cached(vllm_worker, A, prompt, use_cache=False) == 0
    assert _cached(vllm_worker, A, prompt, use_cache=False) == 0
    assert _cached(vllm_worker, A, prompt) == 0


def test_tenant_flush_makes_its_prefixes_unreachable_and_spares_others(vllm_worker):
    prompt = [p + 4 for p in PROMPT]
    _cached(vllm_worker, A, prompt)
    _cached(vllm_worker, B, prompt)
    result = vllm_worker.flush({"scope": "tenant", "tenant": "1"})
    assert result["tiers"]["l1"] >= 4 and result["blocks_freed"] >= result["tiers"]["l1"]
    assert vllm_worker.probe({"scope": "tenant", "tenant": "1"}) == {"remaining_blocks": 0, "ok": True}
    assert _cached(vllm_worker, A, prompt) == 0
    assert _cached(vllm_worker, B, prompt) > 0
    assert vllm_worker.flush({"scope": "tenant", "tenant": "1"})["blocks_freed"] >= 0  # idempotent


def test_model_flush_reaches_every_scope(vllm_worker):
    prompt = [p + 5 for p in PROMPT]
    _cached(vllm_worker, A, prompt)
    _cached(vllm_worker, B, prompt)
    vllm_worker.flush({"scope": "model"})
    assert vllm_worker.probe({"scope": "model"})["ok"]
    assert _cached(vllm_worker, A, prompt) == 0
    assert _cached(vllm_worker, B, prompt) == 0
    # L3-only scopes have nothing to delete on a vLLM replica, and say so
    assert vllm_worker.flush({"scope": "key_version", "tenant": "1", "version": 1})["blocks_freed"] == 0
    with pytest.raises(ValueError):
        vllm_worker.flush({"scope": "bogus"})


def test_stop_logprobs_and_seed(vllm_worker):
    out = complete(vllm_worker, _req(A, max_tokens=6, logprobs=3))
    assert len(out["logprobs"]) == 6 and all(lp <= 0 for lp in out["logprobs"])
    assert all(len(top) <= 3 for top in out["top_logprobs"])
    first = complete(vllm_worker, _req(A, max_tokens=6, temperature=1.0, seed=7))
    again = complete(vllm_worker, _req(A, max_tokens=6, temperature=1.0, seed=7))
    assert first["token_ids"] == again["token_ids"]
    full = complete(vllm_worker, _req(A, max_tokens=12))
    text = full["text"]
    stop = text[3:5]
    if stop.strip():
        cut = complete(vllm_worker, _req(A, max_tokens=12, stop=[stop]))
        assert cut["finish_reason"] == "stop" and stop not in cut["text"] and text.startswith(cut["text"])


def test_bad_requests_are_error_events(vllm_worker):
    assert vllm_worker.collect(_req(A, prompt=[10 ** 6]))[-1]["code"] == "invalid_prompt"
    assert vllm_worker.collect(_req(A, prompt=[]))[-1]["code"] == "invalid_prompt"
    assert vllm_worker.collect(_req(A, prompt=[1] * 2000, max_tokens=100))[-1]["code"] == "context_length_exceeded"
    assert vllm_worker.collect(_req(A, expected_revision="r0"))[-1]["code"] == "revision_changed"
    bad = vllm_worker.collect({**_req(A), "widen": True})
    assert bad[-1]["code"] == "invalid_request"


def test_tenant_quotas_concurrency_and_inflight_tokens(vllm_worker):
    assert vllm_worker.collect(_req(A, max_concurrent_requests=0))[-1]["code"] == "tenant_busy"
    err = vllm_worker.collect(_req(A, max_inflight_tokens=0))[-1]  # 0 admits nothing
    assert err["code"] == "inflight_limit" and err["retryable"]
    # one request may exceed a bound alone, as on the reference engine
    assert vllm_worker.collect(_req(A, max_inflight_tokens=10))[-1]["type"] == "finished"


def test_cancel_stops_a_running_stream_and_cancel_tenant_waits_for_it(vllm_worker):
    stream = vllm_worker.stream(_req(A, max_tokens=1500, prompt=PROMPT[:40], request_id="cancel-me"))
    assert next(stream)["type"] == "prefilled"
    next(stream)
    assert vllm_worker.cancel("cancel-me")
    rest = list(stream)
    assert rest[-1]["type"] == "error" and rest[-1]["code"] == "cancelled"
    assert len(rest) < 300

    events: list = []
    t = threading.Thread(target=lambda: events.extend(
        vllm_worker.stream(_req(B, max_tokens=1500, prompt=PROMPT[:40], request_id="tenant-stop"))))
    t.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    out = vllm_worker.cancel_tenant("2", reason="suspended")
    t.join(timeout=30)
    assert out["cancelled"] == 1 and out["remaining"] == 0
    assert events[-1]["code"] == "request_stopped" and events[-1]["retryable"]  # its client still waits


def test_a_tenant_below_its_share_starts_ahead_of_a_flooder_s_queue(vllm_worker):
    from workers.fair_gate import FairGate

    saved, vllm_worker.gate = vllm_worker.gate, FairGate(1)  # one request inside vLLM at a time
    try:
        started: list[str] = []

        def run(salt, tenant, n, tag):
            for ev in vllm_worker.stream(_req(salt, prompt=PROMPT[:20 + n], tenant=tenant, max_tokens=24)):
                if ev["type"] == "prefilled":
                    started.append(tag)

        flood = [threading.Thread(target=run, args=(A, "flood", i, f"flood{i}")) for i in range(5)]
        for t in flood:
            t.start()
        deadline = time.monotonic() + 30
        while vllm_worker.gate.waiting() < 4:  # one runs, four wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim = threading.Thread(target=run, args=(B, "victim", 0, "victim"))
        victim.start()
        for t in [*flood, victim]:
            t.join(timeout=120)
        assert started.index("victim") <= 1  # the next slot after the running flood request
    finally:
        vllm_worker.gate = saved


def test_stats_count_per_tenant_tokens_and_kv_events_match_the_router_s_hashes(vllm_worker):
    prompt = [p + 6 for p in PROMPT]
    since = vllm_worker.events.seq + 1
    _cached(vllm_worker, A, prompt, cache_salt="s")
    _cached(vllm_worker, A, prompt, cache_salt="s")
    stats = vllm_worker.stats()
    rows = {r["tenant"]: r for r in stats["usage"]}
    assert rows["1"]["query_tokens"] > 0 and rows["1"]["effective_hit_tokens"] > 0
    assert stats["tiers"]["l1"]["capacity_blocks"] == vllm_worker.info()["num_blocks"] > 0
    assert stats["resident_blocks"]["l1"]["1"] >= 4
    # the gateway's hashes for this request (namespace fields + the tenant's salt) are what was stored
    fields = vllm_worker.info()["namespace_fields"]
    expected = request_hashes(fields, A, prompt, request_salt("s"))
    stored = [h for b in vllm_worker.kv_events(since)["batches"] for e in b["events"] if e["type"] == "stored"
              for h in e["hashes"]]
    assert set(h.hex() for h in expected) <= set(stored)
    other = request_hashes(fields, B, prompt, request_salt("s"))
    assert not set(h.hex() for h in other) & set(stored)


def test_router_figures_carry_the_engine_s_capacity_and_what_l1_and_l2_hold(vllm_worker):
    w, a = vllm_worker, vllm_worker._active
    prompt = [p + 8 for p in PROMPT]
    _cached(w, A, prompt, cache_salt="capacity")
    w.kv_events(w.events.seq)  # forwards the tier service's L2 events into the replica's log
    router, stats = w.info()["router"], w.stats()
    engine_blocks = a.engine.vllm_config.cache_config.num_gpu_blocks  # what vLLM allocated
    l2 = stats["tiers"]["l2"] if a.tiers is not None else {}  # the tier service's own L2 figures
    assert engine_blocks > 0 and w.info()["num_blocks"] == engine_blocks
    assert router["capacity_tokens"] == (engine_blocks + l2.get("capacity_blocks", 0)) * a.block_size
    assert router["cached_tokens"] == (w.blocks.count() + l2.get("used_blocks", 0)) * a.block_size
    assert 0 < router["cached_tokens"] <= router["capacity_tokens"]
    if a.tiers is not None:  # the prompt's 4 full blocks were written through to L2 and count there too
        assert l2["capacity_blocks"] > 0 and l2["used_blocks"] >= 4
        assert router["cached_tokens"] >= (w.blocks.count() + 4) * a.block_size


def test_rollout_starts_the_new_revision_drains_and_retires_the_old(vllm_worker, vllm_checkpoint):
    path = vllm_checkpoint[0]
    prompt = [p + 7 for p in PROMPT]
    _cached(vllm_worker, A, prompt)
    staged = vllm_worker.stage_revision({"label": "r2", "checkpoint_path": str(path)})
    assert staged["revision"] == "r2"
    assert vllm_worker.info()["revision"] == "r1"  # nothing serves from it yet
    switched = vllm_worker.switch_revision("r2", drain_seconds=5)
    assert switched["switched"] and switched["from"] == "r1" and switched["aborted"] == 0
    assert vllm_worker.info()["revision"] == "r2"
    events = vllm_worker.collect(_req(A, prompt))
    assert events[0]["revision"] == "r2" and events[0]["cached_tokens"] == 0  # a new engine, a new cache
    assert vllm_worker.collect(_req(A, prompt, expected_revision="r1"))[-1]["code"] == "revision_changed"


def test_a_flushed_scope_never_gets_its_old_salt_back_when_generations_are_forgotten(vllm_worker, monkeypatch):
    import workers.vllm_worker as vw

    monkeypatch.setattr(vw, "_SCOPE_MEMORY", 1)
    prompt = [p + 8 for p in PROMPT]
    c = secrets.token_bytes(32)
    _cached(vllm_worker, A, prompt)
    assert _cached(vllm_worker, A, prompt) > 0
    vllm_worker.flush({"scope": "tenant", "tenant": "1"})
    _cached(vllm_worker, c, prompt, tenant="3")
    vllm_worker.flush({"scope": "tenant", "tenant": "3"})  # a second flushed scope: past the memory
    assert _cached(vllm_worker, A, prompt) == 0  # still a miss: tenant 1's pre-flush blocks stay unreachable
