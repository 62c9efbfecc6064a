"""Deleting a model or a revision over the admin API, up to the job it queues (issue 44, item 1): the
model is gone for everyone at once, a second DELETE answers the same job, the name stays taken until
the job succeeded; a revision delete refuses the active one and hides the revision at once. The jobs
themselves run against real workers in ``tests/jobs/test_model_delete.py``."""

from __future__ import annotations

import json

import pytest

from tests.controlplane.helpers import assert_error, audit_events, post

URL = "/api/admin/models"


@pytest.fixture
def queued(monkeypatch):
    """Jobs are recorded, not sent: ``queued`` lists the ids a request enqueued."""
    from controlplane.jobs import services

    sent: list[int] = []
    monkeypatch.setattr(services, "_enqueue", lambda job: sent.append(job.pk))
    return sent


@pytest.fixture
def model(db, actor):
    from controlplane.registry.services import model_create, revision_create
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import tenant_create

    deployment = model_create(actor=actor, name="tiny-del", preset="tiny", revision={"label": "r1", "seed": 3})
    revision_create(actor=actor, deployment=deployment, label="r2", seed=4)
    grant_create(actor=actor, tenant=tenant_create(actor=actor, slug="acme", name="Acme"), deployment=deployment)
    return deployment


def _delete(client, url, reason=None, *, query=""):
    body = json.dumps({"reason": reason}) if reason is not None else ""
    return client.delete(url + query, data=body, content_type="application/json")


def test_delete_hides_the_model_at_once_and_queues_one_job(admin_client, model, queued):
    from controlplane.tenants.models import Grant
    from controlplane.tenants.selectors import grant_get_deployment, grant_list

    resp = _delete(admin_client, f"{URL}/tiny-del", "retired")
    assert resp.status_code == 202, resp.content
    job = resp.json()
    assert (job["kind"], job["scope"], job["model"], job["status"]) == ("model_delete", "model", "tiny-del", "queued")
    assert job["job"] == {"id": job["id"], "status": "queued"} and queued == [job["id"]]
    assert_error(admin_client.get(f"{URL}/tiny-del"), 404, "model_not_found")
    assert "tiny-del" not in [m["name"] for m in admin_client.get(URL).json()]
    tenant = model.grants.get().tenant
    assert grant_get_deployment(tenant, "tiny-del") is None  # what serving resolves: a 404 like a missing model
    assert list(grant_list(tenant=tenant)) == []  # what /v1/models lists
    assert Grant.objects.filter(deployment=model).count() == 1  # the job ends it, audited
    # while it runs, a DELETE answers the same job (no second job, no second event)
    again = _delete(admin_client, f"{URL}/tiny-del", query="?reason=again")
    assert again.status_code == 202 and again.json()["id"] == job["id"] and queued == [job["id"]]
    assert len(audit_events("model.delete")) == 1 and len(audit_events("model_delete.request")) == 1
    assert audit_events("model.delete")[0].reason == "retired"
    # the name is taken until the job succeeded: its replicas and L3 objects are named after it
    taken = post(admin_client, URL, {"name": "tiny-del", "preset": "tiny", "revision": {"label": "r1", "seed": 3}})
    assert_error(taken, 409, "model_deleting")


def test_a_failed_delete_job_is_retried_by_a_second_delete_and_a_purged_name_is_free(admin_client, model,
                                                                                     queued, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.deletes import model_mark_purged

    first = _delete(admin_client, f"{URL}/tiny-del", query="?reason=retired").json()["id"]
    FlushJob.objects.filter(pk=first).update(status="failed")
    second = _delete(admin_client, f"{URL}/tiny-del", "retry").json()["id"]
    assert second != first and queued == [first, second]
    FlushJob.objects.filter(pk=second).update(status="succeeded")
    model_mark_purged(deployment=model)
    assert_error(_delete(admin_client, f"{URL}/tiny-del", "once more"), 404, "model_not_found")
    created = post(admin_client, URL, {"name": "tiny-del", "preset": "tiny", "revision": {"label": "r1", "seed": 3}})
    assert created.status_code == 201, created.content
    assert [m["name"] for m in admin_client.get(URL).json()] == ["tiny-del"]
    assert admin_client.get(f"{URL}/tiny-del").json()["revisions"][0]["label"] == "r1"


def test_delete_requests_are_validated(admin_client, viewer_client, model, queued):
    assert_error(_delete(admin_client, f"{URL}/tiny-del"), 422, "reason_required")
    assert_error(_delete(admin_client, f"{URL}/tiny-del", "  "), 422, "reason_required")
    bad = admin_client.delete(f"{URL}/tiny-del", data="{not json", content_type="application/json")
    assert_error(bad, 422, "invalid_json")
    extra = admin_client.delete(f"{URL}/tiny-del", data=json.dumps({"reason": "x", "force": True}),
                                content_type="application/json")
    assert_error(extra, 422)
    assert_error(_delete(admin_client, f"{URL}/nope", "x"), 404, "model_not_found")
    assert_error(_delete(viewer_client, f"{URL}/tiny-del", "x"), 403)
    assert_error(_delete(admin_client, f"{URL}/tiny-del/revisions/r1", "x"), 409, "revision_active")
    assert_error(_delete(admin_client, f"{URL}/tiny-del/revisions/r9", "x"), 404, "revision_not_found")
    assert_error(_delete(admin_client, f"{URL}/tiny-del/revisions/r2"), 422, "reason_required")
    assert queued == []
    assert admin_client.get(f"{URL}/tiny-del").status_code == 200  # nothing changed


def test_deleting_an_inactive_revision_hides_it_and_queues_its_flush(admin_client, model, queued):
    resp = _delete(admin_client, f"{URL}/tiny-del/revisions/r2", "bad weights")
    assert resp.status_code == 202, resp.content
    job = resp.json()
    assert (job["kind"], job["scope"], job["model"], job["revision"]) == ("revision_delete", "revision", "tiny-del",
                                                                          "r2")
    assert queued == [job["id"]]
    assert [r["label"] for r in admin_client.get(f"{URL}/tiny-del").json()["revisions"]] == ["r1"]
    rollout = post(admin_client, f"{URL}/tiny-del/rollout", {"revision": "r2"})
    assert_error(rollout, 404, "revision_not_found")
    assert_error(_delete(admin_client, f"{URL}/tiny-del/revisions/r2", "again"), 404, "revision_not_found")
    # a deleted label is not reused: KV and audit history name revisions by label
    again = post(admin_client, f"{URL}/tiny-del/revisions", {"label": "r2", "seed": 4})
    assert_error(again, 409)
    assert audit_events("revision.delete")[0].target == "tiny-del@r2"
    # the flush of any scope cannot name it any more either
    flush = post(admin_client, "/api/admin/flush-jobs", {"scope": "revision", "model": "tiny-del", "revision": "r2",
                                                         "reason": "x"})
    assert_error(flush, 404, "revision_not_found")


def test_a_revision_a_rollout_is_going_to_cannot_be_deleted(admin_client, model, queued):
    assert post(admin_client, f"{URL}/tiny-del/rollout", {"revision": "r2"}).status_code == 202
    assert_error(_delete(admin_client, f"{URL}/tiny-del/revisions/r2", "x"), 409, "revision_in_rollout")
