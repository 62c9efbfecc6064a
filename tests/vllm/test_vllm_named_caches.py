"""Named caches on a vLLM replica (``workers.named_caches.VllmNamedCaches``): prewarm pins the
prompt's blocks in Strata's L2 and L3 (vLLM's own device cache cannot be edited per block), a later
completion of the prefix loads them with identical greedy output, the pin survives the tenant's own
flood of a small L2, and a drop deletes the L2 blocks and the L3 bytes. One engine for the module."""

from __future__ import annotations

import base64
import os
import secrets
import time

import pytest

from tests.l3_workers import L3Site
from tests.vllm.test_vllm_tiers import _prompt, _reset_vllm, _run, _worker

BS = 32  # vLLM's block size here


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    s = L3Site(tmp_path_factory.mktemp("vllm-named"))
    s.master = base64.b64decode(os.environ["STRATA_MASTER_KEY"])  # wins over the key file in vLLM's processes
    return s


@pytest.fixture(scope="module")
def worker(site, vllm_checkpoint):
    w = _worker(site, vllm_checkpoint[0], l2_mb=2)  # 2 MiB: 64 blocks of 32 tokens
    yield w
    w.close()


def test_prewarm_of_a_bad_request_is_an_error(worker, site):
    out = worker.prewarm(site.request("n0", [], scope_salt=secrets.token_bytes(32)), time.time() + 60)
    assert set(out) == {"error"} and out["error"]["code"] == "invalid_prompt" and not out["error"]["retryable"]


def test_prewarm_hits_after_vllm_lost_it_and_drop_deletes_l2_and_l3(worker, site):
    salt = secrets.token_bytes(32)
    prompt = _prompt(300, 71)  # 9 full blocks; one 256-token L3 chunk
    req = site.request("n1", prompt, scope_salt=salt)
    cold = _run(worker, site, "n1c", secrets.token_bytes(32), prompt)  # another tenant: the uncached output

    warm = worker.prewarm(req, time.time() + 3600)
    assert warm.pop("usage")["prompt_tokens"] == 300
    assert warm == {"tokens": 300, "cached_tokens": 0, "tiers": {"l1": 288, "l2": 288, "l3": 256}, "pinned": True}
    assert worker.cache_resident(req) == {"tiers": {"l1": 288, "l2": 288, "l3": 256}}
    files = site.files("n1")
    assert len(files) == 1

    _reset_vllm(worker)  # vLLM's device cache lost it: Strata's L2 serves it
    hit = _run(worker, site, "n1", salt, prompt)
    assert hit["usage"]["cached_tokens"] == 288
    assert hit["token_ids"] == cold["token_ids"]
    assert worker.cache_resident({**req, "cache_salt": "other-user"})["tiers"] == {"l1": 0, "l2": 0, "l3": 0}
    assert worker.cache_pin(req, None)["tiers"]["l2"] == 288  # unpinned, still resident

    bpb = worker._active.kv_layout().bytes_per_block
    l3_bytes = sum(f.stat().st_size for f in files)
    dropped = worker.cache_drop(req)
    assert dropped == {"tiers": {"l1": 0, "l2": 9, "l3": 1}, "bytes": 9 * bpb + l3_bytes}
    assert not any(f.exists() for f in files)
    assert worker.cache_resident(req)["tiers"]["l2"] == 0 and worker.cache_resident(req)["tiers"]["l3"] == 0
    assert worker.cache_drop(req) == {"tiers": {"l1": 0, "l2": 0, "l3": 0}, "bytes": 0}

    _reset_vllm(worker)
    miss = _run(worker, site, "n1", salt, prompt)
    assert miss["usage"]["cached_tokens"] == 0
    assert miss["token_ids"] == cold["token_ids"]
    assert worker.check_integrity()


def test_a_pinned_prefix_survives_the_tenants_own_flood_of_l2(worker, site):
    salt = secrets.token_bytes(32)
    named = site.request("n2", _prompt(300, 81), scope_salt=salt, persist=False)
    plain = site.request("n2", _prompt(300, 82), scope_salt=salt, persist=False)
    assert worker.prewarm(named, time.time() + 3600)["tiers"]["l2"] == 288
    plain_warm = worker.prewarm(plain, None)
    assert plain_warm["pinned"] is False and plain_warm["tiers"] == {"l1": 288, "l2": 288, "l3": 0}
    for i in range(12):  # 144 blocks of the same tenant through a 64-block L2
        _run(worker, site, "n2", salt, _prompt(400, 200 + i), persist=False, max_tokens=1)
    assert worker.stats()["tiers"]["l2"]["evictions"] > 0
    assert worker.cache_resident(named)["tiers"]["l2"] == 288
    assert worker.cache_resident(plain)["tiers"]["l2"] < 288
    _reset_vllm(worker)
    assert _run(worker, site, "n2", salt, named["prompt"], persist=False)["usage"]["cached_tokens"] == 288
    assert worker.check_integrity()
