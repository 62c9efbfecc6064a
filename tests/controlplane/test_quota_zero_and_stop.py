"""Quotas whose null means a worker default: a zero is refused with a clear 422 (never stored, never
silently the default) and the audit records what a null stands for. Suspending a tenant stops its
running requests on every replica (``gateway.cancel_tenant``) before the change is reported done."""

from __future__ import annotations

import pytest

from tests.controlplane.helpers import assert_error, audit_events, patch, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"


@pytest.fixture
def acme(admin_client):
    assert post(admin_client, URL, {"slug": "acme", "name": "Acme"}).status_code == 201


@pytest.mark.parametrize("quota", ["max_concurrent_requests", "max_inflight_tokens"])
def test_a_zero_concurrency_or_inflight_quota_is_refused_with_a_clear_422(admin_client, acme, quota):
    from controlplane.tenants.models import Tenant

    err = assert_error(patch(admin_client, f"{URL}/acme", {"quotas": {quota: 0}}), 422)
    assert quota in err["message"] and "run nothing" in err["message"] and "suspend" in err["message"]
    created = post(admin_client, URL, {"slug": "zero", "name": "Zero", "quotas": {quota: 0}})
    assert_error(created, 422)
    assert getattr(Tenant.objects.get(slug="acme"), quota) is None and not Tenant.objects.filter(slug="zero")
    assert patch(admin_client, f"{URL}/acme", {"quotas": {quota: 1}}).status_code == 200


def test_quota_audit_records_what_a_null_stands_for(admin_client, acme):
    from workers.cache_worker import DEFAULT_TENANT_CONCURRENCY

    created = audit_events("tenant.create")[-1].new_value["quotas"]
    assert created["max_concurrent_requests"] is None
    assert str(DEFAULT_TENANT_CONCURRENCY) in created["effective"]["max_concurrent_requests"]
    assert "max_inflight_tokens" in created["effective"] and "requests_per_minute" not in created["effective"]

    assert patch(admin_client, f"{URL}/acme", {"quotas": {"max_concurrent_requests": 2}}).status_code == 200
    assert patch(admin_client, f"{URL}/acme", {"quotas": {"max_concurrent_requests": None,
                                                          "requests_per_minute": None,
                                                          "tokens_per_minute": 10}}).status_code == 200
    event = audit_events("tenant.quotas")[-1]
    assert event.old_value == {"max_concurrent_requests": 2, "tokens_per_minute": None}  # null = unlimited
    assert event.new_value == {"max_concurrent_requests": None, "tokens_per_minute": 10, "effective": {
        "max_concurrent_requests": f"the default, {DEFAULT_TENANT_CONCURRENCY} per worker"}}


@pytest.fixture
def stops(monkeypatch):
    """``gateway.cancel_tenant`` recorded (the fan-out itself is tested below and against real workers)."""
    from controlplane.runtime import gateway

    calls, answer = [], {"replicas": {"cache-worker:m:0": {"cancelled": 2, "remaining": 0}}, "failed": []}

    def cancel_tenant(tenant_id, *, reason):
        calls.append((tenant_id, reason))
        return answer

    monkeypatch.setattr(gateway, "cancel_tenant", cancel_tenant)
    return calls, answer


def test_suspending_a_tenant_stops_its_running_requests_before_answering(admin_client, acme, stops):
    from controlplane.tenants.models import Tenant

    calls, _ = stops
    resp = patch(admin_client, f"{URL}/acme", {"status": "suspended"})
    assert resp.status_code == 200 and resp.json()["status"] == "suspended"
    tenant = Tenant.objects.get(slug="acme")
    assert calls == [(tenant.pk, "tenant suspended")]
    stopped = audit_events("tenant.requests_stopped")[-1]
    assert stopped.new_value == {"stopped": 2, "failed": []} and stopped.result == "ok"
    assert patch(admin_client, f"{URL}/acme", {"name": "Acme 2"}).status_code == 200
    assert patch(admin_client, f"{URL}/acme", {"status": "active"}).status_code == 200
    assert len(calls) == 1  # only a suspension stops requests


def test_a_replica_that_cannot_be_reached_makes_the_suspension_a_503_that_a_repeat_retries(admin_client, acme,
                                                                                          stops):
    from controlplane.tenants.models import Tenant

    calls, answer = stops
    answer["failed"] = ["cache-worker:m:1"]
    err = assert_error(patch(admin_client, f"{URL}/acme", {"status": "suspended"}), 503)
    assert "could not be reached" in err["message"]
    assert Tenant.objects.get(slug="acme").status == "suspended"  # no new request is admitted meanwhile
    assert audit_events("tenant.requests_stopped")[-1].result == "error"
    answer["failed"] = []
    assert patch(admin_client, f"{URL}/acme", {"status": "suspended"}).status_code == 200
    assert len(calls) == 2


def test_cancel_tenant_fans_out_to_every_replica_of_every_deployment(actor, monkeypatch):
    from controlplane.common.errors import Unavailable
    from controlplane.registry.models import ModelDeployment
    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway

    model_create(actor=actor, name="one", preset="tiny", revision={"label": "r1", "seed": 1})
    model_create(actor=actor, name="two", preset="tiny", revision={"label": "r1", "seed": 2})
    ModelDeployment.objects.filter(name="two").update(replicas=2)
    seen = []

    def call(spec, method, *args, replica=None, create=True, **kwargs):
        seen.append((spec.deployment, replica, method, args, kwargs.get("reason"), create))
        if (spec.deployment, replica) == ("two", 1):
            raise Unavailable("down")
        return None if spec.deployment == "one" else {"cancelled": 1, "remaining": 0}

    monkeypatch.setattr(gateway, "call", call)
    monkeypatch.setattr(gateway, "_ray_configured", lambda: True)
    out = gateway.cancel_tenant(7, reason="tenant offboarded")
    assert sorted((d, r) for d, r, *_ in seen) == [("one", 0), ("two", 0), ("two", 1)]
    assert all(m == "cancel_tenant" and a == ("7",) and why == "tenant offboarded" and not create
               for _, _, m, a, why, create in seen)  # never starts a worker just to cancel
    assert out == {"replicas": {"cache-worker:one:0": {"absent": True},
                                "cache-worker:two:0": {"cancelled": 1, "remaining": 0}},
                   "failed": ["cache-worker:two:1"]}
    monkeypatch.setattr(gateway, "_ray_configured", lambda: False)
    assert gateway.cancel_tenant(7, reason="x")["skipped"]  # no Ray at all: nothing can be running


def test_offboarding_stops_running_requests_at_once_even_before_its_job_runs(admin_client, acme, stops):
    from controlplane.tenants.models import Tenant

    calls, answer = stops
    answer["failed"] = ["cache-worker:m:1"]  # the job retries those; the offboarding itself stands
    assert admin_client.delete(f"{URL}/acme").status_code in (200, 202)
    assert calls == [(Tenant.objects.get(slug="acme").pk, "tenant offboarded")]
    assert audit_events("tenant.requests_stopped")[-1].new_value == {"stopped": 2, "failed": ["cache-worker:m:1"]}
