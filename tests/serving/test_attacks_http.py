"""Attacks mounted over HTTP against the real server (uvicorn + Ray worker): each would succeed
without its defence.

- cache flood: tenant A floods with completions and KV uploads; tenant B's hot prefix keeps hitting
  (fair-share eviction);
- KV transplant: uploaded KV under another prompt's tokens never changes a completion (origin rule),
  for the uploader itself and for the members of its share group;
- NaN bytes are a 422; an oversize token list a 413 that does not stall another tenant;
- a client that disconnects cancels its request on the worker (streamed and non-streamed).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import threading
import time

import httpx
import openai
import pytest
import torch

FLOOD_MODEL = "tiny-flood"
REVISION = {"label": "r1", "seed": 5}


@pytest.fixture
def small(platform, actor):
    """A deployment whose worker has a small pool (128 blocks = 2,048 tokens), granted to every tenant."""
    import ray

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name=FLOOD_MODEL, preset="tiny", revision=dict(REVISION))
    for tenant in platform.tenants.values():
        grant_create(actor=actor, tenant=tenant, deployment=deployment)
    handle = worker_actor.launch(FLOOD_MODEL, "tiny", dict(REVISION), l1_mb=1)
    assert ray.get(handle.info.remote())["num_blocks"] == 128
    spec = gateway.spec_for(deployment)
    yield spec
    gateway.forget(FLOOD_MODEL)
    ray.kill(handle)


@pytest.fixture
def slow(platform, actor):
    """A deployment of the ``small`` model: decoding takes seconds, so a cancel always has time to land."""
    import ray

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name="small-cancel", preset="small", revision=dict(REVISION))
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=deployment)
    handle = worker_actor.launch("small-cancel", "small", dict(REVISION), l1_mb=64, l2_mb=0)
    ray.get(handle.ping.remote())
    yield gateway.spec_for(deployment)
    gateway.forget("small-cancel")
    ray.kill(handle)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(platform, tenant: str, prompt, **kw):
    max_tokens = kw.pop("max_tokens", 1)
    return platform.client(tenant).completions.create(model=FLOOD_MODEL, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, **kw)


def _kv(platform, tenant: str, op: str, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/kv/{op}", json={"model": FLOOD_MODEL, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys[tenant]}"})


def _store(platform, tenant: str, tokens: list[int], kv: torch.Tensor) -> httpx.Response:
    return _kv(platform, tenant, "store", {"tokens": tokens, "kv": base64.b64encode(kv.numpy().tobytes()).decode()})


def _retrieve(platform, tenant: str, tokens: list[int]) -> torch.Tensor:
    r = _kv(platform, tenant, "retrieve", {"tokens": tokens})
    assert r.status_code == 200, r.text
    body = r.json()
    return torch.frombuffer(bytearray(base64.b64decode(body["kv"])), dtype=torch.float32).view(*body["shape"])


def test_a_tenant_flooding_completions_and_uploads_cannot_evict_another_tenants_hot_prefix(platform, small):
    hot = _tokens(512, 1)
    assert _complete(platform, "globex", hot + [7]).usage.prompt_tokens_details.cached_tokens == 0
    assert _complete(platform, "globex", hot + [8]).usage.prompt_tokens_details.cached_tokens == 512
    page = (1, 2, 2, 16, 2, 16)

    served, throttled, lock = [0], [0], threading.Lock()

    def flood(worker: int) -> None:
        # Each of 4 concurrent attackers alternates uploads (63 blocks) and completions (38 blocks)
        # until 8 went through: at least 8 x 38 blocks through a 128-block pool. Over its in-flight or
        # concurrency bound the attacker gets 429s (throttled, never served) and keeps trying.
        deadline = time.monotonic() + 120
        i = worker
        while served[0] < 8 and time.monotonic() < deadline:
            i += 4
            try:
                if i % 2:
                    r = _store(platform, "acme", _tokens(1008, 100 + i), torch.randn(63, *page[1:]))
                    ok = r.status_code == 200
                    assert ok or r.status_code in (429, 503), r.text  # throttled or refused, never served
                else:
                    _complete(platform, "acme", _tokens(600, 200 + i))
                    ok = True
            except (openai.RateLimitError, openai.InternalServerError):
                ok = False
            with lock:
                (served if ok else throttled)[0] += 1

    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(flood, range(4)))
    assert served[0] >= 8, (served, throttled)
    assert _complete(platform, "globex", hot + [9]).usage.prompt_tokens_details.cached_tokens == 512
    stats = httpx.get(f"{platform.url}/readyz").status_code  # the server is fine afterwards
    assert stats == 200


def test_kv_transplant_never_changes_the_uploaders_own_completion(platform, small):
    real, forged = _tokens(160, 21), _tokens(160, 22)
    expected = _complete(platform, "initech", real, max_tokens=8).choices[0].text
    _complete(platform, "acme", forged + [1])
    r = _store(platform, "acme", real[:144], _retrieve(platform, "acme", forged)[:9].contiguous())
    assert r.status_code == 200 and r.json()["stored_blocks"] == 9, r.text
    out = _complete(platform, "acme", real, max_tokens=8)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # the upload is never a completion's cache
    assert out.choices[0].text == expected
    assert _complete(platform, "acme", real, max_tokens=8).usage.prompt_tokens_details.cached_tokens == 144


def test_kv_transplant_never_changes_a_completion_for_the_uploader_or_its_share_group(platform, small, actor):
    from controlplane.tenants.access import share_group_add, share_group_create

    group = share_group_create(actor=actor, slug="transplant", name="Transplant")
    share_group_add(actor=actor, group=group, tenant=platform.tenants["acme"])
    share_group_add(actor=actor, group=group, tenant=platform.tenants["globex"])
    real, forged = _tokens(160, 11), _tokens(160, 12)
    expected = _complete(platform, "initech", real, max_tokens=8).choices[0].text  # an outsider, cold
    _complete(platform, "acme", forged + [1])
    forged_kv = _retrieve(platform, "acme", forged)[:9]
    assert forged_kv.shape[0] == 9
    r = _store(platform, "acme", real[:144], forged_kv.contiguous())
    assert r.status_code == 200 and r.json()["stored_blocks"] == 9, r.text
    lookup = _kv(platform, "acme", "lookup", {"tokens": real[:144]}).json()
    assert lookup == {"hit_tokens": 144, "origin": "upload"}  # paired: the upload is really there
    victim = _complete(platform, "globex", real, max_tokens=8)  # a fellow member: not served the upload
    assert victim.usage.prompt_tokens_details.cached_tokens == 0
    assert victim.choices[0].text == expected
    own = _complete(platform, "acme", real, max_tokens=8)  # the uploader itself: reuses only model KV
    assert own.choices[0].text == expected
    assert _kv(platform, "globex", "lookup", {"tokens": real[:144]}).json()["origin"] == "model"


def test_nan_upload_is_a_422_and_an_oversize_token_list_a_413_without_stalling_others(platform, small):
    kv = torch.randn(2, 2, 2, 16, 2, 16)
    kv[1, 0, 0, 0, 0, 0] = float("nan")
    r = _store(platform, "acme", _tokens(32, 3), kv)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_kv"
    good = _store(platform, "acme", _tokens(32, 3), torch.randn(2, 2, 2, 16, 2, 16))
    assert good.status_code == 200  # paired: the same upload with finite values is accepted
    with cf.ThreadPoolExecutor(2) as pool:
        big = pool.submit(_kv, platform, "acme", "lookup", {"tokens": [1] * 200_000})
        other = pool.submit(_complete, platform, "globex", _tokens(40, 4))
        assert other.result(timeout=60).usage.prompt_tokens == 40
        assert big.result(timeout=60).status_code == 413
    r = _kv(platform, "acme", "lookup", {"tokens": [2**32]})
    assert r.status_code in (400, 422) and "error" in r.json()


def _wait_idle(spec, before: int) -> dict:
    from controlplane.runtime import gateway

    deadline = time.monotonic() + 20
    while True:
        info = gateway.call(spec, "info")
        if info["cancelled"] > before and info["running"] == 0:
            return info
        assert time.monotonic() < deadline, f"request not cancelled: {info}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request_and_frees_its_blocks(platform, slow, stream):
    from controlplane.runtime import gateway

    small = slow
    before = gateway.call(small, "info")["cancelled"]
    # A whole answer must still be running when its client leaves after 1 s: a 2,048-token prompt (its
    # prefill alone takes longer on a CPU), since this random model may emit its end token within a
    # second of decoding a short one
    prompt = _tokens(64, 5) if stream else _tokens(2048, 5)
    body = {"model": "small-cancel", "prompt": prompt, "max_tokens": 2000, "temperature": 0, "stream": stream}
    headers = {"Authorization": f"Bearer {platform.keys['acme']}"}
    if stream:
        with httpx.stream("POST", f"{platform.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token arrived; now the client goes away
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{platform.url}/v1/completions", json=body, headers=headers, timeout=1.0)
    info = _wait_idle(small, before)
    assert info["running"] == 0
    assert gateway.call(small, "check_integrity") is True


def test_leaving_a_share_group_stops_reuse_at_once_and_flushes_what_it_created(platform, small, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.tenants.access import share_group_add, share_group_create, share_group_remove

    group = share_group_create(actor=actor, slug="leavers", name="Leavers")
    for slug in ("acme", "globex"):
        share_group_add(actor=actor, group=group, tenant=platform.tenants[slug])
    shared = _tokens(96, 31)
    assert _complete(platform, "globex", shared + [1]).usage.prompt_tokens_details.cached_tokens == 0
    assert _complete(platform, "acme", shared + [2]).usage.prompt_tokens_details.cached_tokens == 96
    share_group_remove(actor=actor, group=group, tenant=platform.tenants["acme"], reason="contract ended")
    assert _complete(platform, "acme", shared + [3]).usage.prompt_tokens_details.cached_tokens == 0
    assert _complete(platform, "globex", shared + [4]).usage.prompt_tokens_details.cached_tokens == 96
    job = FlushJob.objects.get(scope="tenant", tenant=platform.tenants["acme"])
    assert "leavers" in job.reason
