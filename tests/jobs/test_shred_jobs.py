"""Crypto-shred jobs: step 1 deletes the wrapped key (with its audit event), step 2 makes every worker
drop the key and that version's L3 objects, step 3 verifies with a probe; per-worker results,
progress, retries without double effects, and the offboarding job shredding every version.

The unit tests stand in for the workers at the gateway boundary (``gateway.call``); the end-to-end
tests run a real Celery worker against real Ray cache workers.
"""

from __future__ import annotations

import time

import pytest

from tests.controlplane.helpers import post
from tests.jobs.conftest import wait_for

REASON = "customer asked for erasure"


class FakeWorkers:
    """``gateway.call`` for every deployment: records calls, answers like a worker with a keyring."""

    def __init__(self, objects: int = 3, fail: set[str] | None = None, remaining: int = 0) -> None:
        self.calls: list[tuple[str, str, tuple]] = []
        self.objects, self.fail, self.remaining = objects, set(fail or ()), remaining

    def __call__(self, spec, method, *args, **kwargs):
        from controlplane.common.errors import Unavailable

        self.calls.append((spec.deployment, method, args))
        if spec.deployment in self.fail:
            raise Unavailable(f"worker {spec.deployment} did not answer {method}")
        if method == "drop_data_key":
            return {"objects": self.objects, "bytes": self.objects * 1000}
        if method == "flush":
            return {"blocks_freed": 2, "bytes": 64}
        if method == "probe":
            return {"remaining_blocks": self.remaining, "ok": self.remaining == 0}
        if method == "cancel_tenant":
            return {"cancelled": 1, "remaining": 0}
        raise AssertionError(f"unexpected worker call {method}")

    def of(self, method):
        return [(d, args) for d, m, args in self.calls if m == method]


@pytest.fixture
def setup(db, actor, monkeypatch, settings):
    """Two deployments (two workers), tenant acme with versions 1 (retired) and 2 (active)."""
    from controlplane.jobs import services
    from controlplane.registry.services import model_create
    from controlplane.tenants import datakeys
    from controlplane.tenants.services import tenant_create

    settings.STRATA_DATA_KEY_CACHE_SECONDS = 0
    datakeys.forget_all()
    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    for i, name in enumerate(("tiny-a", "tiny-b")):
        model_create(actor=actor, name=name, preset="tiny", revision={"label": "r1", "seed": 40 + i})
    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    datakeys.data_key_ensure(tenant=tenant)
    datakeys.data_key_rotate(actor=actor, tenant=tenant)
    yield tenant
    datakeys.forget_all()


def _fake(monkeypatch, **kwargs) -> FakeWorkers:
    from controlplane.runtime import gateway

    fake = FakeWorkers(**kwargs)
    monkeypatch.setattr(gateway, "call", fake)
    return fake


def test_shred_runs_its_three_steps_on_every_worker(setup, actor, monkeypatch):
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.datakeys import data_key_shred
    from controlplane.tenants.models import DataKey
    from tests.controlplane.helpers import audit_actions

    fake = _fake(monkeypatch)
    job = data_key_shred(actor=actor, tenant=setup, version=1, reason=REASON)
    assert (job.kind, job.scope, job.key_version, job.status) == ("shred", "tenant", 1, "queued")
    job = job_execute(job_id=job.pk)

    assert job.status == "succeeded" and job.verified
    scope = {"tenant": str(setup.pk), "version": 1}
    assert sorted(fake.of("drop_data_key")) == [("tiny-a", (scope,)), ("tiny-b", (scope,))]
    assert sorted(fake.of("probe")) == [(d, ({"scope": "key_version", **scope},)) for d in ("tiny-a", "tiny-b")]
    assert {k: v for k, v in job.results.items() if ":drop:" in k} == {
        f"cache-worker:{d}:0:drop:v1": {"status": "ok", "objects": 3, "bytes": 3000} for d in ("tiny-a", "tiny-b")}
    # the tenant's running requests were stopped on every worker before any key was dropped
    assert sorted(fake.of("cancel_tenant")) == [("tiny-a", (str(setup.pk),)), ("tiny-b", (str(setup.pk),))]
    assert [m for _, m, _ in fake.calls].index("drop_data_key") > 1
    assert job.results["cache-worker:tiny-a:0:cancel"] == {"status": "ok", "cancelled": 1, "remaining": 0}
    assert (job.progress_done, job.progress_total) == (4, 4)
    steps = [s["step"] for s in job.steps]
    assert steps.index("keys_deleted") < steps.index("keys_dropped") < steps.index("keys_verified")
    key = DataKey.objects.get(tenant=setup, version=1)
    assert key.state == "shredded" and key.wrapped is None
    assert DataKey.objects.get(tenant=setup, version=2).state == "active"  # the other version is untouched
    actions = audit_actions()
    assert actions.index("shred.request") < actions.index("data_key.shred") < actions.index("shred.complete")
    from controlplane.audit.models import AuditEvent

    complete = AuditEvent.objects.filter(action="shred.complete").last().new_value
    assert complete["objects_deleted"] == 6 and complete["bytes_deleted"] == 6000 and complete["versions"] == [1]


def test_the_key_is_gone_before_any_worker_is_asked_and_workers_wait_for_web_caches(setup, actor, monkeypatch,
                                                                                   settings):
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.datakeys import data_key_shred
    from controlplane.tenants.models import DataKey

    settings.STRATA_DATA_KEY_CACHE_SECONDS = 0.4
    fake = _fake(monkeypatch)
    seen = []
    real = fake.__call__

    def call(spec, method, *args, **kwargs):
        if method == "drop_data_key":
            key = DataKey.objects.get(tenant=setup, version=1)
            seen.append((key.state, key.wrapped, time.monotonic()))
        return real(spec, method, *args, **kwargs)

    from controlplane.runtime import gateway

    monkeypatch.setattr(gateway, "call", call)
    job = data_key_shred(actor=actor, tenant=setup, version=1, reason=REASON)
    start = time.monotonic()
    job_execute(job_id=job.pk)
    assert seen and all(state == "shredded" and wrapped is None for state, wrapped, _ in seen)
    assert seen[0][2] - start >= 0.3  # no web process still hands out the key when workers drop it


def test_an_unreachable_worker_is_retried_without_redoing_the_others(setup, actor, monkeypatch):
    from controlplane.jobs import services
    from controlplane.tenants.datakeys import data_key_shred
    from tests.controlplane.helpers import audit_events

    fake = _fake(monkeypatch, fail={"tiny-b"})
    job = data_key_shred(actor=actor, tenant=setup, version=1, reason=REASON)
    with pytest.raises(services.RetryLater):
        services.job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == "running" and (job.progress_done, job.progress_total) == (1, 4)
    assert job.results["cache-worker:tiny-b:0:cancel"]["status"] == "failed"  # stopping requests comes first
    assert fake.of("drop_data_key") == []
    fake.fail.clear()
    job = services.job_execute(job_id=job.pk)
    assert job.status == "succeeded" and job.attempts == 2
    assert [d for d, _ in fake.of("cancel_tenant")] == ["tiny-a", "tiny-b", "tiny-b"]  # tiny-a stopped once
    assert [d for d, _ in fake.of("drop_data_key")] == ["tiny-a", "tiny-b"]
    assert len(audit_events("data_key.shred")) == 1  # step 1 once
    assert services.job_execute(job_id=job.pk).status == "succeeded"  # final: a rerun changes nothing
    assert len(fake.of("drop_data_key")) == 2


def test_a_worker_still_down_on_the_last_attempt_leaves_the_job_partial(setup, actor, monkeypatch):
    from controlplane.jobs import services
    from controlplane.tenants.datakeys import data_key_shred

    _fake(monkeypatch, fail={"tiny-b"})
    job = data_key_shred(actor=actor, tenant=setup, version=1, reason=REASON)
    job = services.job_execute(job_id=job.pk, final_attempt=True)
    assert job.status == "partial" and not job.verified and "tiny-b" in job.error


def test_a_probe_that_still_finds_objects_fails_verification(setup, actor, monkeypatch):
    from controlplane.jobs.services import RetryLater, job_execute
    from controlplane.tenants.datakeys import data_key_shred

    fake = _fake(monkeypatch, remaining=4)
    job = data_key_shred(actor=actor, tenant=setup, version=1, reason=REASON)
    with pytest.raises(RetryLater, match="dropping the key there again"):  # attempts are left: the drop is redone
        job_execute(job_id=job.pk)
    drops = len(fake.of("drop_data_key"))
    job = job_execute(job_id=job.pk, final_attempt=True)
    assert len(fake.of("drop_data_key")) == 2 * drops  # every unverified worker dropped the key again
    assert job.status == "partial" and job.verified is False
    assert "keys_verify_failed" in [s["step"] for s in job.steps]


def test_offboarding_job_flushes_then_shreds_every_version(setup, actor, monkeypatch):
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.models import DataKey
    from controlplane.tenants.services import tenant_offboard

    fake = _fake(monkeypatch)
    states_at_flush = []

    def call(spec, method, *args, **kwargs):
        if method == "flush":
            states_at_flush.append(set(DataKey.objects.filter(tenant=setup).values_list("state", flat=True)))
        return fake(spec, method, *args, **kwargs)

    from controlplane.runtime import gateway

    monkeypatch.setattr(gateway, "call", call)
    job = job_execute(job_id=tenant_offboard(actor=actor, tenant=setup, reason="contract ended").flush_job.pk)
    assert job.kind == "offboard" and job.status == "succeeded" and job.verified
    assert states_at_flush and all(s == {"shredded"} for s in states_at_flush)  # keys gone before any worker
    assert (job.progress_done, job.progress_total) == (8, 8)  # 2 workers x (cancel + flush + 2 versions)
    assert set(job.results) == {f"cache-worker:{d}:0{k}" for d in ("tiny-a", "tiny-b")
                                for k in ("", ":cancel", ":drop:v1", ":drop:v2")}
    methods = [m for _, m, _ in fake.calls]
    assert max(i for i, m in enumerate(methods) if m == "cancel_tenant") < methods.index("flush")
    assert methods.index("drop_data_key") > max(i for i, m in enumerate(methods) if m == "flush")
    assert sorted(args[0]["version"] for _, args in fake.of("drop_data_key")) == [1, 1, 2, 2]
    assert set(DataKey.objects.filter(tenant=setup).values_list("state", flat=True)) == {"shredded"}


# ---------------------------------------------------------------------- end to end (Celery + Ray)
def _final(admin_client, job_id, timeout=120):
    return wait_for(lambda: (j := admin_client.get(f"/api/admin/flush-jobs/{job_id}").json())["status"]
                    in ("succeeded", "partial", "failed") and j, timeout=timeout)


def _cached(platform, tenant, prompt):
    out = platform.client(tenant).completions.create(model=platform.model, prompt=prompt, max_tokens=1,
                                                     temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


def test_shred_job_through_a_real_celery_worker(engine_platform, admin_client, celery_worker_factory):
    import ray

    from controlplane.tenants.models import DataKey
    from workers import actor as worker_actor

    platform = engine_platform  # on both engines (on vLLM, the L3 of Strata's KV connector)

    prompt = "Board minutes, strictly confidential. " * 6
    _cached(platform, "acme", prompt)  # the first request creates acme's data key v1
    _cached(platform, "acme", prompt * 4)  # long enough for an L3 object sealed under v1
    ray.get(worker_actor.find(platform.model, 0).drain_writes.remote(), timeout=120)
    url = "/api/admin/tenants/acme/data-keys"
    assert post(admin_client, f"{url}/rotate").status_code == 201
    celery_worker_factory()
    resp = admin_client.delete(f"{url}/1?reason=erasure")
    assert resp.status_code == 202, resp.content
    job = _final(admin_client, resp.json()["id"])
    assert job["status"] == "succeeded" and job["verified"] is True, job
    assert job["progress"]["done"] == job["progress"]["total"] >= 1
    row = next(r for r in job["results"] if r["worker"] == f"cache-worker:{platform.model}:0:drop:v1")
    assert row["status"] == "ok"
    assert row["objects"] >= 1 and row["bytes"] > 0  # v1's L3 objects deleted
    key = DataKey.objects.get(tenant=platform.tenants["acme"], version=1)
    assert key.state == "shredded" and key.wrapped is None
    assert _cached(platform, "acme", prompt) > 0  # v2 serves on; L1 pages are not encrypted objects
    assert admin_client.get("/api/admin/audit/verify").json()["ok"] is True


def _workers_drop_keys() -> bool:
    from workers.cache_worker import CacheWorker

    return hasattr(CacheWorker, "drop_data_key")


@pytest.mark.skipif(not _workers_drop_keys(),
                    reason="needs CacheWorker.drop_data_key and probe scope 'key_version' (the worker side of "
                           "crypto-shredding, issue 9), not there yet")
def test_real_workers_drop_the_key_and_its_objects_then_the_probe_is_clean(platform, admin_client,
                                                                           celery_worker_factory):
    prompt = "Merger plans, do not forward. " * 12
    for _ in range(2):
        _cached(platform, "acme", prompt)
        _cached(platform, "globex", prompt)
    celery_worker_factory()
    resp = admin_client.delete("/api/admin/tenants/acme/data-keys/1?reason=erasure")
    assert resp.status_code == 202 and resp.json()["rotated_to"] == 2
    job = _final(admin_client, resp.json()["id"])
    assert job["status"] == "succeeded" and job["verified"] is True, job
    rows = [r for r in job["results"] if r["worker"].endswith(":drop:v1")]
    assert rows and all(r["status"] == "ok" and r["objects"] >= 0 and r["bytes"] >= 0 for r in rows)
    # globex's key and cache are untouched; acme keeps serving under v2
    assert _cached(platform, "globex", prompt) > 0
    assert _cached(platform, "acme", prompt) >= 0


def test_a_replica_that_started_during_a_flush_is_flushed_on_the_retry(setup, actor, monkeypatch):
    """tiny-b was down when the flush reached it (nothing to flush: not running), then came up and
    served the tenant before the verification: the job retries and flushes it, never ends partial."""
    from controlplane.jobs import services

    class StartsDuringTheFlush(FakeWorkers):
        def __call__(self, spec, method, *args, **kwargs):
            if spec.deployment == "tiny-b" and not self.of("probe"):
                self.calls.append((spec.deployment, method, args))
                return None  # not running yet (gateway.call without create)
            if spec.deployment == "tiny-b" and method == "probe" and len(self.of("probe")) < 3:
                self.calls.append((spec.deployment, method, args))
                return {"remaining_blocks": 5, "ok": False}  # it came up and cached the tenant's prompts
            return super().__call__(spec, method, *args, **kwargs)

    fake = StartsDuringTheFlush()
    monkeypatch.setattr("controlplane.runtime.gateway.call", fake)
    job = services.flush_job_request(actor=actor, scope="tenant", tenant=setup, reason="model updated")
    with pytest.raises(services.RetryLater, match="not verified: flushing them again"):
        services.job_execute(job_id=job.pk)
    job = services.job_execute(job_id=job.pk)
    assert job.status == "succeeded" and job.verified and job.attempts == 2
    assert [d for d, _ in fake.of("flush")] == ["tiny-a", "tiny-b", "tiny-b"]  # tiny-a flushed once
    retry = next(s for s in job.steps if s["step"] == "verify_retry")
    assert retry["replicas"] == ["cache-worker:tiny-b:0"] and retry["redo"] == ["cache-worker:tiny-b:0"]
