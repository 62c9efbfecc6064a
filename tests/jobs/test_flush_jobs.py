"""Flush jobs end to end: admin API -> row -> real Celery worker -> Ray cache workers -> verified."""

from __future__ import annotations

import pytest

from tests.controlplane.helpers import post
from tests.jobs.conftest import wait_for

PREFIX = "Quarterly numbers, confidential, do not share outside the tenant. " * 4


def _cached(platform, tenant, prompt=PREFIX, model=None):
    out = platform.client(tenant).completions.create(model=model or platform.model, prompt=prompt, max_tokens=1,
                                                     temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


def _job(admin_client, job_id):
    return admin_client.get(f"/api/admin/flush-jobs/{job_id}").json()


def _final(admin_client, job_id, timeout=120):
    return wait_for(lambda: (j := _job(admin_client, job_id))["status"] in ("succeeded", "partial", "failed")
                    and j, timeout=timeout)


def test_flush_of_one_tenant_misses_for_it_and_other_tenant_still_hits(engine_platform, admin_client,
                                                                         celery_worker_factory):
    platform = engine_platform  # on both engines
    _cached(platform, "acme")
    _cached(platform, "globex")
    assert _cached(platform, "acme") > 0 and _cached(platform, "globex") > 0
    celery_worker_factory()
    resp = post(admin_client, "/api/admin/flush-jobs", {"scope": "tenant", "tenant": "acme",
                                                        "reason": "customer asked for erasure"})
    assert resp.status_code == 202, resp.content
    job = _final(admin_client, resp.json()["id"])
    assert job["status"] == "succeeded" and job["verified"] is True
    assert job["progress"]["done"] == job["progress"]["total"] >= 1
    row = next(r for r in job["results"] if r["worker"].startswith(f"cache-worker:{platform.model}"))
    assert row["status"] == "ok" and row["blocks_freed"] > 0
    assert _cached(platform, "acme") == 0
    assert _cached(platform, "globex") > 0
    actions = [e["action"] for e in admin_client.get("/api/admin/audit?limit=500").json()["items"]]
    assert "flush.request" in actions and "flush.complete" in actions
    assert admin_client.get("/api/admin/audit/verify").json()["ok"] is True


def test_flush_job_requests_are_validated(platform, admin_client, viewer_client):
    assert post(admin_client, "/api/admin/flush-jobs", {"scope": "tenant", "reason": "x"}).status_code == 422
    assert post(admin_client, "/api/admin/flush-jobs", {"scope": "planet", "reason": "x"}).status_code == 422
    assert post(admin_client, "/api/admin/flush-jobs", {"scope": "all"}).status_code == 422
    assert post(admin_client, "/api/admin/flush-jobs", {"scope": "tenant", "tenant": "nope",
                                                        "reason": "x"}).status_code == 404
    assert post(viewer_client, "/api/admin/flush-jobs", {"scope": "all", "reason": "x"}).status_code == 403
    assert admin_client.get("/api/admin/flush-jobs/999999").status_code == 404


def test_killed_celery_worker_mid_job_resumes_without_double_effects(platform, admin_client, actor,
                                                                     celery_worker_factory):
    from controlplane.registry.services import model_create
    from controlplane.tenants.access import grant_create

    models = [platform.model]
    for i in range(2):
        d = model_create(actor=actor, name=f"tiny-flush-{i}", preset="tiny", revision={"label": "r1", "seed": 20 + i})
        grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=d)
        models.append(d.name)
    for name in models:
        _cached(platform, "acme", model=name)
        assert _cached(platform, "acme", model=name) > 0
    slow = celery_worker_factory(step_delay=4.0)
    job_id = post(admin_client, "/api/admin/flush-jobs", {"scope": "all", "reason": "model updated"}).json()["id"]
    wait_for(lambda: _job(admin_client, job_id)["progress"]["done"] >= 1, timeout=120)
    slow.kill()
    mid = _job(admin_client, job_id)
    assert mid["status"] == "running" and mid["progress"]["done"] < mid["progress"]["total"]
    done_before = {r["worker"]: r for r in mid["results"] if r["status"] == "ok"}
    celery_worker_factory()
    job = _final(admin_client, job_id)
    assert job["status"] == "succeeded" and job["verified"] is True
    assert job["attempts"] >= 2
    assert [s["step"] for s in job["steps"]].count("attempt") >= 2  # the history shows the resume
    results = {r["worker"]: r for r in job["results"]}
    assert len(results) == len(models)
    for worker, before in done_before.items():
        assert results[worker] == before  # not flushed twice: the first attempt's figures stand
    assert all(r["blocks_freed"] > 0 for r in results.values())
    for name in models:
        assert _cached(platform, "acme", model=name) == 0


def test_unreachable_worker_is_retried_then_recorded_as_partial(platform, monkeypatch, actor):
    """Unreachability is simulated here (a live actor cannot be made unreachable on demand)."""
    from controlplane.common.errors import Unavailable
    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway

    model_create(actor=actor, name="tiny-down", preset="tiny", revision={"label": "r1", "seed": 3})
    _cached(platform, "acme")
    real_call = gateway.call

    def flaky(spec, method, *args, **kwargs):
        if spec.deployment == "tiny-down":
            raise Unavailable("worker tiny-down did not answer flush")
        return real_call(spec, method, *args, **kwargs)

    monkeypatch.setattr(gateway, "call", flaky)
    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    job = services.flush_job_request(actor=actor, scope="all", reason="test")
    with pytest.raises(services.RetryLater):
        services.job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == "running" and job.results["cache-worker:tiny-down:0"]["status"] == "failed"
    job = services.job_execute(job_id=job.pk, final_attempt=True)
    assert job.status == FlushJob.Status.PARTIAL
    assert "tiny-down" in job.error
    assert job.results[f"cache-worker:{platform.model}:0"]["status"] == "ok"
    assert services.job_execute(job_id=job.pk).status == FlushJob.Status.PARTIAL  # final: a rerun changes nothing


def test_offboarding_revokes_keys_at_once_and_flushes_everywhere(engine_platform, admin_client,
                                                                   celery_worker_factory):
    import openai

    platform = engine_platform  # on both engines

    _cached(platform, "acme")
    _cached(platform, "globex")
    assert _cached(platform, "acme") > 0
    celery_worker_factory()
    resp = admin_client.delete("/api/admin/tenants/acme?reason=contract%20ended")
    assert resp.status_code == 200, resp.content
    with pytest.raises(openai.AuthenticationError):
        _cached(platform, "acme")
    job = _final(admin_client, resp.json()["flush_job"]["id"])
    assert job["status"] == "succeeded" and job["verified"] and job["tenant"] == "acme"
    assert job["kind"] == "offboard"
    assert sum(r.get("blocks_freed", 0) for r in job["results"]) > 0
    assert _cached(platform, "globex") > 0  # another tenant's hot prefix survives the offboarding


def test_a_model_never_started_is_not_running_with_nothing_to_do(platform, monkeypatch, actor):
    """A replica that was never started holds nothing: its result says so (``not_running``), apart
    from a failure, and the job succeeds."""
    from controlplane.jobs import services
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.services import model_create

    model_create(actor=actor, name="tiny-idle", preset="tiny", revision={"label": "r1", "seed": 4})
    _cached(platform, "acme")
    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    job = services.job_execute(job_id=services.flush_job_request(actor=actor, scope="all", reason="test").pk)
    assert job.status == FlushJob.Status.SUCCEEDED
    idle = job.results["cache-worker:tiny-idle:0"]
    assert idle["status"] == "not_running" and idle["reason"] == "not running: nothing to do"
    served = job.results[f"cache-worker:{platform.model}:0"]
    assert served["status"] == "ok" and served["bytes"] > 0  # the bytes it freed, not "—"


def test_a_job_requested_while_the_broker_is_down_is_kept_queued_and_sent_again(
        admin_client, monkeypatch, django_capture_on_commit_callbacks):
    """The broker refusing the message (down, paused) neither fails the operator's request with a 500
    nor strands the job: it stays queued and the workers' reaper sends it once a window has passed."""
    from datetime import timedelta

    from django.utils import timezone
    from kombu.exceptions import OperationalError as BrokerDown

    from controlplane.jobs import services, signals
    from controlplane.jobs.models import FlushJob

    def broker_down(job_id):
        raise BrokerDown("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(services, "job_send", broker_down)
    with django_capture_on_commit_callbacks() as on_commit:
        resp = post(admin_client, "/api/admin/flush-jobs", {"scope": "all", "reason": "model updated"})
    assert resp.status_code in (201, 202), resp.content
    # Run the job's send as the commit would (only it: the audit head log's hook would record a head
    # this test's rolled-back transaction never kept, which later tests' chain verification reads).
    sends = [f for f in on_commit if "_enqueue" in getattr(f, "__qualname__", "")]
    assert len(sends) == 1
    sends[0]()  # the broker refuses: no exception reaches the request
    job_id = resp.json()["id"]
    assert _job(admin_client, job_id)["status"] == "queued"

    sent: list[int] = []
    monkeypatch.setattr(services, "job_send", sent.append)
    assert signals.resume_stale_jobs() == [] and sent == []  # just requested: its message may be in flight
    FlushJob.objects.filter(pk=job_id).update(created_at=timezone.now() - timedelta(seconds=10 * 60))
    assert signals.resume_stale_jobs() == [job_id] and sent == [job_id]
    assert signals.resume_stale_jobs() == [] and sent == [job_id]  # once per staleness window
