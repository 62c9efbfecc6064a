"""Capacity hints: ``GET /api/admin/models/{name}`` and the console's model page show each replica's KV
capacity in tokens (L1 device pages, L2 host pool) and in sequences of the model's full context,
from the replica's own stats (its last sample), on both engines over a real local Ray."""

from __future__ import annotations

import time

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def _until(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def started(ray_cluster, actor):
    """``started(name, **model_create kwargs)``: the deployment created and its replica 0 up; stopped after."""
    import ray

    from controlplane.registry.models import ModelDeployment
    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway

    specs = []

    def start(name: str, **kwargs):
        model_create(actor=actor, name=name, **kwargs)
        spec = gateway.spec_for(ModelDeployment.objects.select_related("active_revision").get(name=name))
        specs.append(spec)
        gateway.get_worker(spec, create=True)
        return spec

    yield start
    for spec in specs:
        handle = gateway.replica_set(spec).cached(0)
        gateway.forget(spec.deployment)
        if handle is not None:
            ray.kill(handle, no_restart=True)


def _capacity(client, name: str) -> dict:
    def answered():
        response = client.get(f"/api/admin/models/{name}")
        assert response.status_code == 200, response.content
        (replica,) = response.json()["capacity"]
        return replica if replica["status"] == "ok" else None

    return _until(f"{name}'s first sample", answered)


def _check_against_the_worker(spec, replica: dict, context: int) -> dict:
    """The hint's figures are the worker's own layout: blocks x block size, and whole sequences."""
    from controlplane.runtime import gateway

    stats = gateway.call(spec, "stats", create=False, replica=0)
    block_size = stats["pool"]["block_size"]
    per_sequence = -(-context // block_size)
    assert (replica["block_size"], replica["context_tokens"]) == (block_size, context)
    assert replica["blocks_per_sequence"] == per_sequence
    own = [n for n in ("l1", "l2") if (stats["tiers"].get(n) or {}).get("capacity_blocks")]
    assert "l1" in own and set(own) <= set(replica["tiers"])
    for name in own:
        blocks = stats["tiers"][name]["capacity_blocks"]
        tier = replica["tiers"][name]
        assert tier["blocks"] == blocks > 0 and tier["tokens"] == blocks * block_size
        assert tier["bytes"] == blocks * stats["bytes_per_block"]
        # paired: a full-context sequence more would not fit, the ones counted do
        assert tier["sequences"] * per_sequence <= blocks < (tier["sequences"] + 1) * per_sequence
    assert replica["tokens"] == sum(replica["tiers"][n]["tokens"] for n in own)
    assert replica["sequences"] == sum(replica["tiers"][n]["sequences"] for n in own)
    return stats


def test_reference_engine_capacity_in_tokens_and_full_context_sequences(admin_client, started):
    from cachecore.model.config import preset

    spec = started("cap-tiny", preset="tiny", revision={"label": "r1", "seed": 3})
    replica = _capacity(admin_client, "cap-tiny")
    _check_against_the_worker(spec, replica, preset("tiny").max_seq_len)
    l1 = replica["tiers"]["l1"]
    print(f"\nstrata tiny: L1 {l1['bytes']} B = {l1['tokens']:,} tokens = {l1['sequences']:,} sequences of "
          f"{replica['context_tokens']:,}; L1+L2 {replica['tokens']:,} tokens")


def test_console_model_page_shows_each_replica_s_capacity(admin_client, started, django_user_model):
    started("cap-page", preset="tiny", revision={"label": "r1", "seed": 4})
    replica = _capacity(admin_client, "cap-page")
    user = django_user_model.objects.create_superuser("cap-admin", "cap@example.com", "pw-cap-admin-1")
    console = Client()
    console.force_login(user)
    html = console.get("/ui/models/").content.decode()
    assert "KV capacity per replica" in html
    assert f"in sequences of the full context ({replica['context_tokens']:,} tokens)" in html
    for name in ("l1", "l2"):
        tier = replica["tiers"][name]
        assert f'<td class="num">{tier["tokens"]:,}</td>' in html
        assert f'<td class="num">{tier["sequences"]:,}</td>' in html
    assert "device pages (L1)" in html and "host pool (L2)" in html


@pytest.mark.slow
def test_vllm_engine_capacity_in_tokens_and_full_context_sequences(admin_client, started, vllm_checkpoint):
    path, hf, _tok = vllm_checkpoint
    spec = started("cap-vllm", preset="", revision={"label": "r1", "path": str(path)}, engine="vllm")
    replica = _capacity(admin_client, "cap-vllm")
    stats = _check_against_the_worker(spec, replica, hf.config.max_position_embeddings)
    assert stats["pool"]["total"] == replica["tiers"]["l1"]["blocks"]  # vLLM's allocated KV blocks
    print(f"\nvLLM: L1 {replica['tiers']['l1']['tokens']:,} tokens = {replica['tiers']['l1']['sequences']:,} "
          f"sequences of {replica['context_tokens']:,}")
