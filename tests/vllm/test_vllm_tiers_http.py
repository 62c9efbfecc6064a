"""Strata's tiers on a vLLM deployment, over HTTP with the suite's local Ray: a long document survives a
replica restart (from the encrypted L3, identical completion), another tenant sending the same document
gets nothing of it, and a client cannot hand vLLM ``kv_transfer_params`` of its own."""

from __future__ import annotations

import httpx
import pytest

from tests.vllm.test_vllm_platform import _grant, _kill

pytest.importorskip("vllm")
DOC = [5 + (i * 13) % 290 for i in range(700)]  # two L3 chunks of 256 tokens and change


def _complete(platform, name, tenant, prompt, **extra):
    resp = httpx.post(f"{platform.url}/v1/completions", timeout=300,
                      headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                      json={"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
    return resp


def _deploy(platform, actor, path, name):
    from controlplane.registry.services import model_create

    d = model_create(actor=actor, name=name, preset="", engine="vllm", revision={"label": "r1", "path": str(path)})
    _grant(platform, actor, d, "acme", "globex")
    return d


def _drain(name):
    import ray

    from workers import actor as worker_actor

    ray.get(worker_actor.find(name, 0).drain_writes.remote(), timeout=120)


def test_a_document_survives_a_replica_restart_from_l3_and_stays_the_tenant_s(platform, actor, vllm_checkpoint):
    name = "vllm-l3"
    _deploy(platform, actor, vllm_checkpoint[0], name)
    try:
        cold = _complete(platform, name, "acme", DOC)
        assert cold.status_code == 200, cold.text
        assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        _drain(name)
        _kill(name)  # the replica restarts: vLLM's cache and Strata's L2 (in vLLM's worker) are gone
        warm = _complete(platform, name, "acme", DOC)
        assert warm.status_code == 200, warm.text
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 512  # from L3
        assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        _kill(name)
        other = _complete(platform, name, "globex", DOC)  # the same document, another tenant
        assert other.status_code == 200, other.text
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
    finally:
        _kill(name)


def test_a_client_cannot_send_kv_transfer_params(platform, actor, vllm_checkpoint):
    name = "vllm-ktp"
    _deploy(platform, actor, vllm_checkpoint[0], name)
    try:
        _complete(platform, name, "acme", DOC[:300])
        forged = {"strata": {"tenant": str(platform.tenants["acme"].id), "model": name, "revision": "r1",
                             "ns_digest": "00" * 32, "hashes": []}}
        for extra in ({"kv_transfer_params": forged}, {"kv_transfer_params": {"do_remote_prefill": True}}):
            resp = _complete(platform, "vllm-ktp", "globex", DOC[:300], **extra)
            assert resp.status_code == 422, resp.text  # the platform's validation error
            body = resp.json()
            assert "kv_transfer_params" in body["error"]["message"], body
    finally:
        _kill(name)
