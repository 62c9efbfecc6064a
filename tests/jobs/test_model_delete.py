"""Deleting a model end to end (issue 44, item 1): admin API -> ``model_delete`` job on a real Celery
worker -> the real Ray replica on the reference engine, with the session's file L3 on disk. Tenants
get 404 at once; the job stops the replica (no actor of the model left), its L3 files leave the disk,
its grants end, the audit event carries the figures; the name can be used again and the new model
never hits the old KV. A revision delete removes that revision's KV, L3 files included."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.controlplane.helpers import audit_events, post
from tests.jobs.conftest import wait_for
from tests.serving.test_quota_paths_http import slow  # noqa: F401  (fixture: a model that decodes slowly)

PROMPT = "Quarterly plan, confidential: revenue by region, hiring, the roadmap and its risks. " * 8


def _l3_root() -> Path:
    return Path(urlsplit(os.environ["STRATA_L3_URL"]).path)


def _l3_files(model: str, revision: str = "*") -> tuple[int, int]:
    """Files (temporary ones included) and bytes on disk under every tenant's directory of ``model``."""
    files = [p for p in _l3_root().glob(f"*/{model}/{revision}/**/*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _cached(platform, tenant: str, model: str | None = None) -> int:
    out = platform.client(tenant).completions.create(model=model or platform.model, prompt=PROMPT, max_tokens=1,
                                                     temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


def _drain_writes(model: str) -> None:
    import ray

    from workers import actor as worker_actor

    ray.get(worker_actor.find(model, 0).drain_writes.remote(), timeout=120)


def _final(admin_client, job_id: int, timeout: float = 180) -> dict:
    def final():
        job = admin_client.get(f"/api/admin/flush-jobs/{job_id}").json()
        return job if job["status"] in ("succeeded", "partial", "failed") else None

    return wait_for(final, timeout=timeout)


def _actors_of(model: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"cache-worker:{model}:")]


def test_deleting_a_model_stops_it_removes_its_kv_everywhere_and_frees_its_name(platform, admin_client, actor,
                                                                                celery_worker_factory):
    import openai

    from controlplane.tenants.access import grant_create
    from controlplane.tenants.models import Grant

    model = platform.model
    for tenant in ("acme", "globex"):
        _cached(platform, tenant)
        assert _cached(platform, tenant) > 0
    _drain_writes(model)
    objects_before, bytes_before = _l3_files(model)
    assert objects_before >= 2 and bytes_before > 0  # each tenant's prompt left L3 chunks on disk
    assert _actors_of(model) == [f"cache-worker:{model}:0"]

    celery_worker_factory()
    resp = admin_client.delete(f"/api/admin/models/{model}?reason=retired")
    assert resp.status_code == 202, resp.content
    # from this moment tenants see it as a model that does not exist
    with pytest.raises(openai.NotFoundError) as missing:
        _cached(platform, "acme")
    assert missing.value.code == "model_not_found"
    assert model not in [m.id for m in platform.client("acme").models.list()]
    assert model not in [m["name"] for m in admin_client.get("/api/admin/models").json()]

    job = _final(admin_client, resp.json()["id"])
    assert job["status"] == "succeeded" and job["verified"] is True, job
    assert job["progress"]["done"] == job["progress"]["total"] == 3  # stop requests, flush, stop: one replica
    rows = {r["worker"]: r for r in job["results"]}
    replica = f"cache-worker:{model}:0"
    assert rows[f"{replica}:cancel"]["status"] == "ok"
    assert rows[replica]["status"] == "ok" and rows[replica]["blocks_freed"] > 0
    assert rows[f"{replica}:stop"]["stopped"] is True
    steps = [s["step"] for s in job["steps"]]
    assert steps.index("requests_stopped") < steps.index("verified") < steps.index("replicas_stopped") \
        < steps.index("l3_deleted") < steps.index("grants_ended") < steps.index("finished")

    assert _actors_of(model) == []  # no Ray actor of the model is left
    assert _l3_files(model) == (0, 0)  # its L3 bytes left the disk
    assert Grant.objects.filter(deployment_id=platform.deployment.pk).count() == 0
    figures = audit_events("model_delete.complete")[-1].new_value
    assert figures["status"] == "succeeded"
    assert (figures["objects_deleted"], figures["bytes_deleted"]) == (objects_before, bytes_before)
    assert figures["replicas_stopped"] == 1 and figures["grants_ended"] == 3 and figures["blocks_freed"] > 0
    assert len(audit_events("grant.delete")) == 3
    assert admin_client.get("/api/admin/audit/verify").json()["ok"] is True

    # the name is free again: the same preset and seed (the same weights, so the same cache keys) start
    # from an empty cache, and then cache as any model does
    created = post(admin_client, "/api/admin/models", {"name": model, "preset": "tiny",
                                                       "revision": {"label": "r1", "seed": 5}})
    assert created.status_code == 201, created.content
    from controlplane.registry.models import ModelDeployment

    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=ModelDeployment.objects.get(name=model))
    assert _cached(platform, "acme") == 0
    assert _cached(platform, "acme") > 0
    with pytest.raises(openai.NotFoundError):  # globex's grant ended with the old model
        _cached(platform, "globex")


def test_deleting_an_inactive_revision_removes_its_kv_from_every_tier(platform, admin_client, actor,
                                                                      celery_worker_factory):
    """r1 cached (L1, L2 and L3) on the running replica, then r2 made active without a rollout (which
    would itself free r1's cache): only the revision delete can remove r1's KV here."""
    from controlplane.registry.models import ModelDeployment
    from controlplane.registry.services import model_activate_revision, revision_create

    model = platform.model
    _cached(platform, "acme")
    _drain_writes(model)
    assert _l3_files(model, "r1")[0] >= 1
    deployment = ModelDeployment.objects.get(name=model)
    r2 = revision_create(actor=actor, deployment=deployment, label="r2", seed=6)
    refused = admin_client.delete(f"/api/admin/models/{model}/revisions/r1?reason=bad")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "revision_active"
    model_activate_revision(actor=actor, deployment=deployment, revision=r2)
    # A LoRA adapter's KV of r1 (objects tagged ``r1~<adapter>``, as vLLM replicas write them) goes with
    # r1, even where no replica would delete it (this reference-engine replica does not know the tag);
    # an adapter's KV of r2 stays.
    chunk = next(p for p in _l3_root().glob(f"*/{model}/r1/**/*") if p.is_file() and not p.name.startswith("."))
    r1_dir = next(parent for parent in chunk.parents if parent.name == "r1")
    variant, kept = (r1_dir.parent / f"{rev}%7Elora9-feedfeedfeedfeed" / chunk.relative_to(r1_dir)
                     for rev in ("r1", "r2"))
    for copy in (variant, kept):
        copy.parent.mkdir(parents=True)
        copy.write_bytes(chunk.read_bytes())

    celery_worker_factory()
    resp = admin_client.delete(f"/api/admin/models/{model}/revisions/r1?reason=bad%20weights")
    assert resp.status_code == 202, resp.content
    job = _final(admin_client, resp.json()["id"])
    assert job["status"] == "succeeded" and job["verified"] is True, job
    row = next(r for r in job["results"] if r["worker"] == f"cache-worker:{model}:0")
    assert row["blocks_freed"] > 0 and row["tiers"]["l3"] >= 1
    assert _l3_files(model, "r1") == (0, 0) and _l3_files(model, "r1%7E*") == (0, 0)
    assert kept.is_file()
    assert [r["label"] for r in admin_client.get(f"/api/admin/models/{model}").json()["revisions"]] == ["r2"]
    figures = audit_events("revision_delete.complete")[-1].new_value
    assert figures["objects_deleted"] >= 1 and figures["bytes_deleted"] > 0


def _run_with_retries(services, job_id: int, attempts: int = 3):
    for _ in range(attempts - 1):
        try:
            return services.job_execute(job_id=job_id)
        except services.RetryLater:
            continue
    return services.job_execute(job_id=job_id, final_attempt=True)


def test_a_model_with_no_replica_running_still_has_its_l3_objects_deleted(platform, admin_client, monkeypatch):
    """Its replica stopped (as ``replicas: 0`` or a crash leaves it): nothing runs that could delete its
    L3 objects, so the job deletes them from the control plane, with what a killed writer left."""
    import ray

    from controlplane.jobs import services
    from workers import actor as worker_actor

    model = platform.model
    _cached(platform, "acme")
    _drain_writes(model)
    ray.kill(worker_actor.find(model, 0), no_restart=True)
    wait_for(lambda: not _actors_of(model), timeout=60)
    chunk = next(p for p in _l3_root().glob(f"*/{model}/r1/**/*") if p.is_file())
    (chunk.parent / f".{chunk.name}.tmp-0123456789abcdef").write_bytes(b"x" * 1000)  # a writer killed mid-write
    objects_before, bytes_before = _l3_files(model)
    assert objects_before >= 2 and bytes_before > 1000

    from controlplane.adapters.models import Adapter
    from controlplane.adapters.selectors import usable
    from controlplane.registry.models import ModelDeployment
    from controlplane.tenants.models import Tenant

    acme = Tenant.objects.get(slug="acme")  # an adapter of the model (registered as on a vLLM model)
    Adapter.objects.create(name=f"{model}-support", deployment=ModelDeployment.objects.get(name=model), tenant=acme,
                           path="/nowhere", digest="ab" * 32, rank=8, alpha=16.0, dtype="float32")
    assert usable(acme, f"{model}-support") is not None

    monkeypatch.setattr(services, "_enqueue", lambda job: None)  # run here, in this process
    job_id = admin_client.delete(f"/api/admin/models/{model}?reason=retired").json()["id"]
    assert usable(acme, f"{model}-support") is None  # at once, with its model
    job = _run_with_retries(services, job_id)  # as the task does: this process's handle of the replica is dead
    assert job.status == "succeeded" and job.verified, (job.error, job.steps)
    assert job.results[f"cache-worker:{model}:0"]["status"] == "not_running"
    assert job.results[f"cache-worker:{model}:0:stop"] == {"status": "not_running", "stopped": False,
                                                           "running_at_kill": 0}
    l3 = next(s for s in job.steps if s["step"] == "l3_deleted")
    assert l3["objects"] == objects_before - 1 and l3["disk_bytes"] == bytes_before
    assert (l3["left_objects"], l3["left_disk_bytes"]) == (0, 0)
    assert _l3_files(model) == (0, 0)
    figures = audit_events("model_delete.complete")[-1].new_value
    assert figures["objects_deleted"] == objects_before - 1 and figures["disk_bytes_freed"] == bytes_before
    assert figures["replicas_stopped"] == 0 and figures["grants_ended"] == 3 and figures["adapters_ended"] == 1
    assert Adapter.objects.get(name=f"{model}-support").state == Adapter.State.DELETED
    assert services.job_execute(job_id=job_id).status == "succeeded"  # final: a rerun changes nothing


def test_a_stream_running_on_a_deleted_model_is_stopped_before_its_replica(platform, slow, admin_client,  # noqa: F811
                                                                           monkeypatch):
    """A 2,000-token stream on a model whose decoding takes seconds: the job stops it (a retryable
    ``request_stopped`` and no token after it), counts it, then stops the replica."""
    import httpx

    from controlplane.jobs import services
    from tests.serving.test_quota_paths_http import SLOW, _events, _open_stream

    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    with httpx.Client() as client:
        cm, lines = _open_stream(client, platform, "acme")
        try:
            job_id = admin_client.delete(f"/api/admin/models/{SLOW}?reason=retired").json()["id"]
            job = _run_with_retries(services, job_id)
            rest = _events(lines)  # returns: the stream ended (it would run for 2,000 tokens otherwise)
        finally:
            cm.__exit__(None, None, None)
    assert job.status == "succeeded" and job.verified, (job.error, job.steps)
    assert job.results[f"cache-worker:{SLOW}:0:cancel"]["cancelled"] == 1
    errors = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "request_stopped", rest[-3:]
    assert not any(isinstance(e, dict) and e.get("choices") for e in rest[rest.index(errors[0]):])
    assert sum(1 for e in rest if isinstance(e, dict) and e.get("choices")) < 1990
    assert _actors_of(SLOW) == []
