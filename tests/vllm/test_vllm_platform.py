"""The platform on vLLM replicas, end to end over HTTP with the suite's local Ray: a rollout job
through Celery, cache-aware routing over two vLLM replicas fed by the KV events the worker derives,
exact multi-turn chat, and a checkpoint Strata's own engine refuses (a Mixtral MoE) served with
tenant isolation and cached tokens."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import torch

from tests.controlplane.helpers import post
from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint
from tests.jobs.conftest import wait_for

pytest.importorskip("vllm")
PROMPT = "The weights of this model were just updated; nothing cached before may be reused. " * 3


def _kill(name: str, replicas: int = 1) -> None:
    import ray

    from controlplane.runtime import gateway
    from workers import actor as worker_actor

    gateway.forget(name)
    for i in range(replicas):
        handle = worker_actor.find(name, i)
        if handle is not None:
            ray.kill(handle, no_restart=True)


def _grant(platform, actor, deployment, *tenants) -> None:
    from controlplane.tenants.access import grant_create

    for slug in tenants or ("acme",):
        grant_create(actor=actor, tenant=platform.tenants[slug], deployment=deployment)


def _complete(platform, model, prompt, tenant="acme", max_tokens=8):
    out = platform.client(tenant).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-llama-r2")
    build_checkpoint("llama", path, seed=12, max_pos=512, **VLLM_CPU_SHAPE)
    return path


def test_rollout_on_vllm_starts_the_new_revision_and_nothing_cached_before_is_reused(
        platform, admin_client, actor, celery_worker_factory, vllm_checkpoint, second_checkpoint):
    import ray

    from controlplane.registry.services import model_create, revision_create
    from workers import actor as worker_actor

    name = "vllm-roll"
    d = model_create(actor=actor, name=name, preset="", engine="vllm",
                     revision={"label": "r1", "path": str(vllm_checkpoint[0])})
    revision_create(actor=actor, deployment=d, label="r2", path=str(second_checkpoint))
    _grant(platform, actor, d)
    try:
        old_text, _ = _complete(platform, name, PROMPT)
        assert _complete(platform, name, PROMPT)[1] > 0
        _complete(platform, name, PROMPT * 4, max_tokens=1)  # long enough for an L3 chunk of r1
        l3_root = Path(urlparse(os.environ["STRATA_L3_URL"]).path)
        ray.get(worker_actor.find(name, 0).drain_writes.remote(), timeout=120)
        assert [p for p in l3_root.glob(f"*/{name}/r1/**/*") if p.is_file()]
        celery_worker_factory()
        resp = post(admin_client, f"/api/admin/models/{name}/rollout", {"revision": "r2", "reason": "new weights"})
        assert resp.status_code == 202, resp.content
        job_id = resp.json()["job"]["id"]
        job = wait_for(lambda: (j := admin_client.get(f"/api/admin/flush-jobs/{job_id}").json())["status"]
                       in ("succeeded", "partial", "failed") and j, timeout=300)
        assert job["status"] == "succeeded" and job["verified"] is True, job
        new_text, cached = _complete(platform, name, PROMPT)
        assert cached == 0 and new_text != old_text
        # the old revision's L3 objects are gone (Strata's tiers under vLLM): none can ever be served
        assert not [p for p in l3_root.glob(f"*/{name}/r1/**/*") if p.is_file()]
        assert _complete(platform, name, PROMPT) == (new_text, cached + _complete(platform, name, PROMPT)[1])
        models = {m["name"]: m for m in admin_client.get("/api/admin/models").json()}
        assert models[name]["active_revision"] == "r2" and models[name]["engine"] == "vllm"
    finally:
        _kill(name)


def test_routing_over_two_vllm_replicas_follows_the_cached_prefix(platform, actor, monkeypatch, vllm_checkpoint):
    from cachecore.routing.hashes import request_hashes
    from controlplane.registry.services import model_create, model_set_replicas
    from controlplane.runtime import gateway
    from controlplane.tenants.selectors import tenant_scope_salt

    name = "vllm-routed"
    monkeypatch.setattr(gateway, "apply_scale", lambda spec, **kw: None)  # started below, in this thread
    d = model_create(actor=actor, name=name, preset="", engine="vllm",
                     revision={"label": "r1", "path": str(vllm_checkpoint[0])})
    d = model_set_replicas(actor=actor, deployment=d, replicas=2)
    _grant(platform, actor, d, "acme", "globex")
    spec = gateway.spec_for(d)
    gateway.replica_set(spec).start_all()
    try:
        prefix = list(range(40, 40 + 160))  # five blocks of 32

        def complete(tenant, tokens):
            r = httpx.post(f"{platform.url}/v1/completions", timeout=120,
                           headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                           json={"model": name, "prompt": tokens, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text[:300]
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        router = gateway.router(spec)
        assert complete("acme", prefix + [7]) == 0
        deadline = time.monotonic() + 60
        while not any(v.namespace_fields for v in router._views.values()):  # the replicas' info was polled
            assert time.monotonic() < deadline, "the router never learned the replicas' namespace fields"
            time.sleep(0.1)
        view = next(v for v in router._views.values() if v.namespace_fields)
        assert view.namespace_fields["block_size"] == 32
        hashes = request_hashes(view.namespace_fields, tenant_scope_salt(platform.tenants["acme"]), prefix)
        deadline = time.monotonic() + 30
        while not router.index.match(hashes, 32):
            assert time.monotonic() < deadline, "the router's index never learned the prefix vLLM computed"
            time.sleep(0.1)
        (holder,) = router.index.match(hashes, 32)
        def idle_views():
            # the router's figures are polled: one taken while the previous request ran still counts it
            # as queued, and a replica with a queue rightly loses to an idle one; wait for a fresh poll
            deadline = time.monotonic() + 20
            while any(v.router.get("queued_requests") or v.router.get("running") for v in router._views.values()):
                assert time.monotonic() < deadline, "the router's view of the replicas never went idle"
                time.sleep(0.05)

        for i in range(4):
            idle_views()
            assert complete("acme", prefix + [100 + i, 7]) >= 128  # 4 of 5 blocks at least: the holder served it
        assert set(router.index.match(hashes, 32)) == {holder}
        # the policy sees each vLLM replica's capacity (its hit clipping and large-write rules are on)
        states = {s.replica_id: s for s in (router._state(router.replicas.replica(i), v)
                                            for i, v in router._views.items())}
        assert len(states) == 2 and all(s.capacity_tokens > 0 and s.cached_tokens <= s.capacity_tokens
                                        for s in states.values())
        assert states[holder].cached_tokens >= 160  # the prefix's five blocks at least
        other = request_hashes(view.namespace_fields, tenant_scope_salt(platform.tenants["globex"]), prefix)
        assert router.index.match(other, 32) == {}
        assert complete("globex", prefix + [7]) == 0
    finally:
        _kill(name, 2)


def test_multi_turn_chat_on_vllm_is_exact_with_its_prefix_cache(platform, actor, vllm_checkpoint):
    from controlplane.registry.services import model_create

    name = "vllm-chat"
    path, hf, tok = vllm_checkpoint
    d = model_create(actor=actor, name=name, preset="", engine="vllm", revision={"label": "r1", "path": str(path)})
    _grant(platform, actor, d)
    try:
        client = platform.client("acme")
        messages = [{"role": "system", "content": "You keep answers short. " * 12},
                    {"role": "user", "content": "Hello world! How are you today?"}]
        turn1 = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
        messages += [{"role": "assistant", "content": turn1.choices[0].message.content},
                     {"role": "user", "content": "The quick brown fox."}]
        turn2 = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
        assert turn2.usage.prompt_tokens_details.cached_tokens >= 32
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        assert len(ids) == turn2.usage.prompt_tokens
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
        assert turn2.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    finally:
        _kill(name)


def test_a_mixtral_our_engine_refuses_is_served_on_vllm_with_isolation(platform, admin_client, actor,
                                                                        tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    build_checkpoint("mixtral", path, seed=3, max_pos=512, **VLLM_CPU_SHAPE)
    name = "vllm-mixtral"
    headers = {"Authorization": f"Bearer {admin_client.token}"}
    refused = httpx.post(f"{platform.url}/api/admin/models", headers=headers, timeout=60,
                         json={"name": "mixtral-strata", "engine": "strata", "revision": {"label": "r1",
                                                                                           "path": str(path)}})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_checkpoint"
    created = httpx.post(f"{platform.url}/api/admin/models", headers=headers, timeout=60,
                         json={"name": name, "revision": {"label": "r1", "path": str(path)}})
    assert created.status_code == 201, created.text
    assert created.json()["engine"] == "vllm"  # the default for a checkpoint vLLM serves here
    from controlplane.registry.models import ModelDeployment

    _grant(platform, actor, ModelDeployment.objects.get(name=name), "acme", "globex")
    try:
        doc = "Tenants never read, probe or evict each other's cache entries. " * 6
        first = _complete(platform, name, doc)
        assert first[1] == 0
        assert _complete(platform, name, doc) == (first[0], _complete(platform, name, doc)[1])
        assert _complete(platform, name, doc)[1] > 0
        assert _complete(platform, name, doc, tenant="globex")[1] == 0  # the same prompt, another tenant
        assert _complete(platform, name, doc, tenant="globex")[1] > 0
    finally:
        _kill(name)


def test_the_kv_api_on_a_vllm_deployment_serves_the_tenant_s_model_kv(platform, actor, vllm_checkpoint):
    from controlplane.registry.services import model_create

    name = "vllm-kv"
    d = model_create(actor=actor, name=name, preset="", engine="vllm",
                     revision={"label": "r1", "path": str(vllm_checkpoint[0])})
    _grant(platform, actor, d, "acme", "globex")
    try:
        tokens = [7 + (i * 5) % 280 for i in range(100)]
        platform.client("acme").completions.create(model=name, prompt=tokens, max_tokens=1, temperature=0)

        def call(tenant, path, **body):
            headers = {"Authorization": f"Bearer {platform.keys[tenant]}"}
            if path == "layout":
                return httpx.get(f"{platform.url}/v1/kv/layout", params={"model": name}, headers=headers, timeout=120)
            return httpx.post(f"{platform.url}/v1/kv/{path}", headers=headers, timeout=120,
                              json={"model": name, "tokens": tokens, **body})

        layout = call("acme", "layout")
        assert layout.status_code == 200, layout.text
        assert layout.json()["block_size"] == 32 and layout.json()["pages"] == "canonical"
        lookup = call("acme", "lookup")
        assert lookup.status_code == 200, lookup.text
        assert lookup.json()["hit_tokens"] == 96 and lookup.json()["origin"] == "model"
        assert call("globex", "lookup").json()["hit_tokens"] == 0  # another tenant's scope
    finally:
        _kill(name)


def test_greedy_output_through_the_api_is_identical_cold_and_cached_around_block_boundaries(
        platform, actor, vllm_checkpoint):
    from controlplane.registry.services import model_create

    name = "vllm-exact"
    path, hf, _ = vllm_checkpoint
    d = model_create(actor=actor, name=name, preset="", engine="vllm", revision={"label": "r1", "path": str(path)})
    _grant(platform, actor, d)
    client = platform.client("acme")
    try:
        for length in (31, 32, 33, 63, 64, 65, 97):
            prompt = [5 + (i * 11 + length) % 300 for i in range(length)]
            outs = [client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"cache_salt": f"exact-{length}"}) for _ in range(2)]
            assert outs[0].usage.prompt_tokens_details.cached_tokens == 0
            assert outs[1].usage.prompt_tokens_details.cached_tokens == (length - 1) // 32 * 32
            assert outs[1].choices[0].text == outs[0].choices[0].text
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, length:].tolist()
            n = outs[0].usage.completion_tokens
            assert n >= 1 and outs[0].choices[0].text == vllm_checkpoint[2].decode(ref[:n])
    finally:
        _kill(name)
