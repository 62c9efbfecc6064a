"""The multi-node scenario, run by ``tests/test_cluster_multinode.py`` in a pytest process of its own
joined to the two-node cluster it started (``STRATA_MULTINODE_ADDRESS``); skipped anywhere else.

One deployment with two replicas (created through the admin API), one on each node; completions over
HTTP (the ASGI app under uvicorn, as the serving tests run it) served by both; a replica killed with
``ray.kill`` leaves routing, every request still succeeds, and it is re-launched and put back; a
flush and a rollout reach and verify every replica; with both replicas restarted (empty L1/L2) a
prompt served before is a hit loaded from the shared L3 directory.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.controlplane.helpers import post
from tests.serving.conftest import asgi_url  # noqa: F401  (its ray_cluster is the one below)

CHILD_ENV = "STRATA_MULTINODE_ADDRESS"
MODEL = "tiny-cluster"
pytestmark = pytest.mark.skipif(not os.environ.get(CHILD_ENV), reason="run by tests/test_cluster_multinode.py")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(address=os.environ[CHILD_ENV], namespace="strata", log_to_driver=False, configure_logging=False)
    yield os.environ[CHILD_ENV]


def _node_of(handle) -> str:
    from ray._private import state

    return state.actors(handle._actor_id.hex())["Address"]["NodeID"]


def _wait(cond, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _complete(url: str, key: str, prompt: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _requests_per_replica() -> dict[int, int]:
    from controlplane.runtime.stats import cluster_stats

    return {w["replica"]: w["totals"]["requests"] for w in cluster_stats(refresh=True)["workers"]
            if w["model"] == MODEL and w["status"] == "ok"}


def test_two_replicas_on_two_nodes(asgi_url, transactional_db, actor, admin_client, monkeypatch):  # noqa: F811
    import ray

    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.models import ModelDeployment
    from controlplane.registry.services import revision_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    monkeypatch.setattr(services, "_enqueue", lambda job: None)  # jobs run here, not on Celery
    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    key = api_key_create(actor=actor, tenant=tenant)[1]
    created = post(admin_client, "/api/admin/models",
                   {"name": MODEL, "preset": "tiny", "revision": {"label": "r1", "seed": 5}, "replicas": 2})
    assert created.status_code == 201 and created.json()["replicas"] == 2
    deployment = ModelDeployment.objects.get(name=MODEL)
    grant_create(actor=actor, tenant=tenant, deployment=deployment)
    spec = gateway.spec_for(deployment)
    rs = gateway.replica_set(spec)
    handles = []
    try:
        # ---- placement: one replica on each node (both advertise strata_worker; SPREAD)
        gateway.get_worker(spec)  # both replicas up (the API's scale-up launched them already)
        handles = [rs.cached(0), rs.cached(1)]
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2 and {_node_of(h) for h in handles} == nodes

        # ---- serving through the router on both replicas
        prompts = [f"request {i}: " + "tell me about ray clusters " * (2 + i % 3) for i in range(12)]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda p: _complete(asgi_url, key, p), prompts))
        assert [a.status_code for a in answers] == [200] * len(prompts), [a.text[:200] for a in answers]
        served = _requests_per_replica()
        assert set(served) == {0, 1} and all(n > 0 for n in served.values()), served
        assert sum(served.values()) >= len(prompts)  # lookups: a re-admitted request counts again

        # ---- failover: a killed replica leaves routing, requests succeed, it comes back
        ray.kill(handles[1], no_restart=True)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: _complete(asgi_url, key, p), prompts[:8]))
        assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
        assert rs.replica(1).failures >= 1
        revived = _wait(lambda: not rs.replica(1).dead and rs.cached(1), "replica 1 to come back")
        assert revived is not handles[1] and ray.get(revived.ping.remote(), timeout=30) is True
        assert rs.replica(1).revivals >= 1 and _node_of(revived) in nodes
        assert _complete(asgi_url, key, "after the restart").status_code == 200

        # ---- a flush reaches and verifies every replica
        job = services.flush_job_request(actor=actor, scope="model", model=MODEL, reason="multi-node test")
        job = services.job_execute(job_id=job.pk)
        assert job.status == FlushJob.Status.SUCCEEDED and job.verified, (job.results, job.error)
        assert set(job.results) == {f"cache-worker:{MODEL}:0", f"cache-worker:{MODEL}:1"}
        assert all(r["status"] == "ok" for r in job.results.values())
        step = next(s for s in job.steps if s["step"] == "verified")
        assert set(step["replicas"]) == set(job.results) and all(p["ok"] for p in step["replicas"].values())

        # ---- a rollout stages and switches every replica and verifies the old revision misses
        revision_create(actor=actor, deployment=deployment, label="r2", seed=6)
        job = services.rollout_request(actor=actor, model=MODEL, revision="r2", reason="multi-node test")
        job = services.job_execute(job_id=job.pk)
        assert job.status == FlushJob.Status.SUCCEEDED and job.verified, (job.results, job.error)
        phases = {f"cache-worker:{MODEL}:{i}:{phase}" for i in (0, 1) for phase in ("stage", "switch")}
        assert set(job.results) == phases
        spec = gateway.spec_for(ModelDeployment.objects.get(name=MODEL))
        assert [gateway.call(spec, "info", replica=i)["revision"] for i in (0, 1)] == ["r2", "r2"]

        # ---- L3: both replicas restarted with empty caches; a prompt seen before is loaded from L3
        l3 = Path(os.environ["STRATA_L3_URL"].removeprefix("file://"))
        long_prompt = "the shared directory keeps the cache across restarts. " * 12  # > one 256-token chunk
        first = _complete(asgi_url, key, long_prompt)
        assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] > 300
        _wait(lambda: any(p.is_file() for p in l3.rglob("*")), "the chunk to reach L3", timeout=60)
        time.sleep(1.0)  # the background writer finishes the whole chunk
        old = [rs.cached(0), rs.cached(1)]
        for handle in old:
            ray.kill(handle, no_restart=True)
        _wait(lambda: all(not rs.replica(i).dead and rs.cached(i) not in (None, *old) for i in (0, 1)),
              "both replicas to come back")
        again = _complete(asgi_url, key, long_prompt)
        assert again.status_code == 200, again.text[:300]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, again.json()["usage"]
        from controlplane.runtime.stats import cluster_stats

        l3_hits = sum(w["tiers"].get("l3", {}).get("hits", 0) for w in cluster_stats(refresh=True)["workers"]
                      if w["model"] == MODEL and w["status"] == "ok")
        assert l3_hits >= 1
    finally:
        handles = [rs.cached(i) for i in (0, 1)]
        gateway.forget(MODEL)
        for handle in handles:
            if handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
