"""A tenant's cache policy reaches the data already stored (issue 17, item 5): over the admin API,
turning ``persist`` off queues an audited ``l3_delete`` job and lowering ``retention_seconds`` an
audited ``l3_expire`` job; run against a real cache worker (the gateway call is routed to it in
process), each deletes that tenant's L3 files on disk, and only what it must.
"""

from __future__ import annotations

import secrets
import time

import pytest

from tests.controlplane.helpers import audit_events, patch
from tests.l3_workers import L3Site, cached_tokens, prompt

URL = "/api/admin/tenants/acme"


def _stored(engine, request, actor, tenant, model, tmp_path, monkeypatch):
    from controlplane.jobs import services
    from controlplane.runtime import gateway
    from controlplane.tenants.services import tenant_create

    monkeypatch.delenv("STRATA_MASTER_KEY", raising=False)  # the site's key file (vLLM's processes inherit this)
    monkeypatch.setattr(services, "_enqueue", lambda job: None)  # the test runs the job itself
    site = L3Site(tmp_path)
    if engine == "vllm":
        from workers.config import WorkerConfig
        from workers.vllm_worker import VllmWorker

        path = request.getfixturevalue("vllm_checkpoint")[0]
        cfg = WorkerConfig(l1_mb=8, l2_mb=0, l3_url=site.l3.as_uri(), master_key_file=str(site.key_file),
                           load_policy="always_load")
        worker = VllmWorker(deployment=model.name, preset="", config=cfg,
                            revision={"label": "r1", "checkpoint_path": str(path)})
        request.addfinalizer(worker.close)
    else:
        worker = site.worker(deployment=model.name)
    other = tenant_create(actor=actor, slug="other", name="Other")
    for t in (tenant, other):
        req = site.request(str(t.pk), prompt(300, 9), scope_salt=secrets.token_bytes(32))
        if engine == "vllm":
            worker.collect(req)
            worker.drain_writes()
        else:
            cached_tokens(worker, req)
    assert len(site.files(str(tenant.pk))) == 1 and len(site.files(str(other.pk))) == 1
    monkeypatch.setattr(gateway, "call", lambda spec, method, *args, **kwargs: getattr(worker, method)(*args))
    return site, worker, tenant, other


@pytest.fixture
def stored(request, db, actor, tenant, model, tmp_path, monkeypatch):
    """A real worker of ``tiny-llama`` whose L3 holds one chunk of acme's and one of another tenant's;
    the jobs' gateway calls go to it."""
    return _stored("strata", request, actor, tenant, model, tmp_path, monkeypatch)


@pytest.fixture(params=["strata", "vllm"])
def stored_on(request, db, actor, tenant, model, tmp_path, monkeypatch):
    """``stored`` on each engine (on vLLM, the L3 of Strata's KV connector)."""
    if request.param == "vllm":
        pytest.importorskip("vllm")
    return _stored(request.param, request, actor, tenant, model, tmp_path, monkeypatch)


def _only_job(kind: str):
    from controlplane.jobs.models import FlushJob

    jobs = list(FlushJob.objects.all())
    assert [(j.kind, j.scope, j.status) for j in jobs] == [(kind, "tenant", "queued")]
    return jobs[0]


def test_turning_persistence_off_queues_an_audited_job_that_deletes_the_tenants_l3_objects(admin_client, stored_on):
    """Defence: ``tenant_update`` queues ``l3_delete``. Without it, no job exists and acme's L3 file
    stays on disk."""
    from controlplane.jobs.services import job_execute

    site, worker, tenant, other = stored_on
    resp = patch(admin_client, URL, {"cache_policy": {"persist": False}, "reason": "customer opted out"})
    assert resp.status_code == 200 and resp.json()["cache_policy"]["persist"] is False
    job = _only_job("l3_delete")
    [event] = audit_events("l3_delete.request")
    assert event.tenant == "acme" and event.reason == "customer opted out" and event.new_value["job"] == job.pk
    assert len(site.files(str(tenant.pk))) == 1  # queued, not run yet

    job = job_execute(job_id=job.pk)
    assert job.status == "succeeded" and job.verified
    assert site.files(str(tenant.pk)) == []  # gone from the disk
    assert len(site.files(str(other.pk))) == 1  # another tenant's object is untouched
    [result] = job.results.values()
    assert result["status"] == "ok" and result["tiers"]["l3"] == 1
    complete = audit_events("l3_delete.complete")[0].new_value
    assert complete["status"] == "succeeded" and complete["objects_deleted"] == 1 and complete["bytes_deleted"] > 0


def test_lowering_the_retention_queues_an_audited_job_that_expires_what_is_now_too_old(admin_client, stored):
    """Defence: ``tenant_update`` queues ``l3_expire`` and the worker applies the new retention.
    Without it, acme's 2-hour-old object outlives a 1-hour retention on disk."""
    from controlplane.jobs.services import job_execute

    site, worker, tenant, other = stored
    worker.l3.store.clock = lambda: time.time() + 2 * 3600  # both objects are 2 h old
    patch(admin_client, URL, {"cache_policy": {"retention_seconds": 7 * 86400}})  # raised: nothing to expire
    from controlplane.jobs.models import FlushJob

    assert not FlushJob.objects.exists()
    patch(admin_client, URL, {"cache_policy": {"retention_seconds": 3600}})
    job = _only_job("l3_expire")
    assert audit_events("l3_expire.request")[0].tenant == "acme"
    job = job_execute(job_id=job.pk)
    assert job.status == "succeeded" and job.verified
    assert site.files(str(tenant.pk)) == [] and len(site.files(str(other.pk))) == 1
    assert worker.l3.retention(str(tenant.pk)) == 3600  # later sweeps of this worker apply it too
