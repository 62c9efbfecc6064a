"""Deleting a vLLM deployment (issue 44, item 1): after its ``model_delete`` job, the replica's actor
process and vLLM's engine process under it are gone, not only the Ray actor's name."""

from __future__ import annotations

import pytest

from tests.jobs.test_model_delete import _actors_of, _final

psutil = pytest.importorskip("psutil")

MODEL = "delete-vllm"  # not the session's shared vLLM deployment: this test kills its replica


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_deleting_a_vllm_model_ends_its_engine_process(vllm_checkpoint, asgi_url, transactional_db, actor,
                                                       admin_client, celery_worker_factory):
    import os

    import ray

    from controlplane.registry.services import model_create
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name=MODEL, preset="", engine="vllm",
                              revision={"label": "r1", "path": str(vllm_checkpoint[0])})
    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    grant_create(actor=actor, tenant=tenant, deployment=deployment)
    import openai

    client = openai.OpenAI(base_url=f"{asgi_url}/v1", api_key=api_key_create(actor=actor, tenant=tenant)[1],
                           max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt="The engine runs in its own process. " * 4, max_tokens=2,
                                    temperature=0)
    assert out.choices[0].text is not None
    handle = worker_actor.find(MODEL, 0)
    pid = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
    engine = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    assert engine, "vLLM's engine core runs in a child process of the replica"
    assert all(_alive(p) for p in [pid, *engine])

    celery_worker_factory()
    resp = admin_client.delete(f"/api/admin/models/{MODEL}?reason=retired")
    assert resp.status_code == 202, resp.content
    job = _final(admin_client, resp.json()["id"], timeout=300)
    assert job["status"] == "succeeded" and job["verified"] is True, job
    assert next(r for r in job["results"] if r["worker"] == f"cache-worker:{MODEL}:0:stop")["stopped"] is True
    assert _actors_of(MODEL) == []
    assert not _alive(pid)
    assert [p for p in engine if _alive(p)] == []  # the engine process is gone too (its GPU freed)
