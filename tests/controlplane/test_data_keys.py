"""L3 data keys through the admin API and services, the master key, and the tenant cache policy.

Pins: rotate / list / shred answer as docs/design.md section 5 says; nothing ever shows key material (clear or
wrapped) in a response or an audit event; a shred deletes the wrapped key in the database (NULL, and
gone from the database file on SQLite) so not even the master key unwraps the version again;
shredding the active version rotates first; offboarding shreds every version; viewers only read; the
worker request carries the tenant's data keys and cache policy; the master key file is created 0600
and refused when others may read it.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from tests.controlplane.helpers import assert_error, audit_events, patch, post

URL = "/api/admin/tenants/acme/data-keys"


@pytest.fixture(autouse=True)
def no_job_dispatch(monkeypatch, settings):
    """Jobs are executed by the tests themselves (``job_execute``), with no cache-key wait."""
    from controlplane.jobs import services
    from controlplane.tenants import datakeys

    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    settings.STRATA_DATA_KEY_CACHE_SECONDS = 0
    datakeys.forget_all()  # tenant ids repeat across tests (rolled back)
    yield
    datakeys.forget_all()


def _unwrap(tenant, version, wrapped):
    from controlplane.tenants.datakeys import unwrap_tenant_key

    return unwrap_tenant_key(wrapped, tenant=tenant, version=version)


def _wrapped(tenant, version) -> bytes:
    from controlplane.tenants.models import DataKey

    return bytes(DataKey.objects.get(tenant=tenant, version=version).wrapped)


def _forms(secret: bytes) -> list[bytes]:
    """Every way a key could leak into text: raw, hex, base64 (padded or not), urlsafe."""
    b64 = base64.b64encode(secret)
    return [secret, secret.hex().encode(), secret.hex().upper().encode(), b64, b64.rstrip(b"="),
            base64.urlsafe_b64encode(secret).rstrip(b"=")]


def _assert_absent(blob: bytes, *secrets_: bytes) -> None:
    for secret in secrets_:
        for form in _forms(secret):
            assert form not in blob, "key material leaked"


# ---------------------------------------------------------------------- data keys: services and API
@pytest.mark.django_db
def test_first_worker_request_creates_version_1_wrapped_by_the_master_key(tenant):
    from controlplane.tenants.selectors import data_key_for_worker

    dk = data_key_for_worker(tenant)
    assert dk["version"] == 1 and dk["shredded"] == []
    assert dk["readable"] == [{"version": 1, "wrapped": dk["wrapped"]}]
    clear = _unwrap(tenant, 1, dk["wrapped"])
    assert len(clear) == 32 and clear not in dk["wrapped"]
    assert [e.new_value for e in audit_events("data_key.create")] == [{"version": 1, "state": "active"}]
    assert data_key_for_worker(tenant)["version"] == 1  # no second version
    assert len(audit_events("data_key.create")) == 1


@pytest.mark.django_db
def test_wrapped_keys_are_bound_to_their_tenant_and_version(tenant, actor):
    from cachecore.crypto import DecryptError
    from controlplane.tenants.selectors import data_key_for_worker
    from controlplane.tenants.services import tenant_create

    other = tenant_create(actor=actor, slug="globex", name="Globex")
    mine, theirs = data_key_for_worker(tenant), data_key_for_worker(other)
    assert _unwrap(tenant, 1, mine["wrapped"]) != _unwrap(other, 1, theirs["wrapped"])
    with pytest.raises(DecryptError):
        _unwrap(other, 1, mine["wrapped"])  # moved to another tenant
    with pytest.raises(DecryptError):
        _unwrap(tenant, 2, mine["wrapped"])  # relabelled as another version


@pytest.mark.django_db
def test_rotate_makes_a_new_active_version_and_keeps_the_old_one_readable(admin_client, tenant):
    from controlplane.tenants.selectors import data_key_for_worker

    data_key_for_worker(tenant)
    resp = post(admin_client, f"{URL}/rotate", {"reason": "quarterly"})
    assert resp.status_code == 201 and resp.json() == {"version": 2}
    listed = admin_client.get(URL).json()
    assert [(k["version"], k["state"]) for k in listed] == [(1, "retired"), (2, "active")]
    assert listed[0]["retired_at"] and listed[1]["retired_at"] is None
    dk = data_key_for_worker(tenant)  # same process: the cached set was dropped at once
    assert dk["version"] == 2 and [r["version"] for r in dk["readable"]] == [1, 2]
    event = audit_events("data_key.rotate")[-1]
    assert event.new_value == {"version": 2, "state": "active", "retired": 1} and event.reason == "quarterly"
    assert post(admin_client, f"{URL}/rotate").status_code == 201  # body optional
    assert [k["state"] for k in admin_client.get(URL).json()] == ["retired", "retired", "active"]


@pytest.mark.django_db
def test_rotate_before_any_use_creates_version_1(admin_client, tenant):
    assert post(admin_client, f"{URL}/rotate").json() == {"version": 1}
    assert [(k["version"], k["state"]) for k in admin_client.get(URL).json()] == [(1, "active")]


@pytest.mark.django_db
def test_list_and_every_answer_never_carry_key_material(admin_client, tenant):
    from controlplane.tenants.selectors import data_key_for_worker

    data_key_for_worker(tenant)
    bodies = [post(admin_client, f"{URL}/rotate").content, admin_client.get(URL).content,
              admin_client.get("/api/admin/tenants/acme").content]
    shred = admin_client.delete(f"{URL}/1?reason=test")
    bodies += [shred.content, admin_client.get(f"/api/admin/flush-jobs/{shred.json()['id']}").content]
    secrets_ = [_wrapped(tenant, 2), _unwrap(tenant, 2, _wrapped(tenant, 2))]
    for body in bodies:
        assert b"wrapped" not in body
        _assert_absent(body, *secrets_)
    assert set(admin_client.get(URL).json()[0]) == {"version", "state", "created", "retired_at", "shredded_at"}


@pytest.mark.django_db
def test_viewers_list_but_may_not_rotate_or_shred(viewer_client, admin_client, tenant):
    post(admin_client, f"{URL}/rotate")
    assert viewer_client.get(URL).status_code == 200
    assert_error(post(viewer_client, f"{URL}/rotate"), 403, "read_only_role")
    assert_error(viewer_client.delete(f"{URL}/1"), 403, "read_only_role")
    assert [k["state"] for k in admin_client.get(URL).json()] == ["active"]


@pytest.mark.django_db
def test_unknown_version_or_tenant_is_404_and_offboarded_tenant_cannot_rotate(admin_client, tenant):
    post(admin_client, f"{URL}/rotate")
    assert_error(admin_client.delete(f"{URL}/7"), 404, "data_key_not_found")
    assert_error(admin_client.get("/api/admin/tenants/nope/data-keys"), 404, "tenant_not_found")
    assert_error(post(admin_client, "/api/admin/tenants/nope/data-keys/rotate"), 404, "tenant_not_found")
    assert admin_client.delete(f"{URL}/abc").status_code == 422
    assert admin_client.delete("/api/admin/tenants/acme").status_code == 200
    assert_error(post(admin_client, f"{URL}/rotate"), 409, "tenant_offboarded")


@pytest.mark.django_db
def test_shred_job_deletes_the_wrapped_key_and_no_master_key_unwraps_it_again(admin_client, tenant):
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.models import DataKey
    from controlplane.tenants.selectors import data_key_for_worker

    data_key_for_worker(tenant)
    post(admin_client, f"{URL}/rotate")
    old_wrapped = _wrapped(tenant, 1)
    resp = admin_client.delete(f"{URL}/1?reason=customer%20request")
    assert resp.status_code == 202, resp.content
    job = resp.json()
    assert (job["kind"], job["scope"], job["tenant"], job["version"], job["status"]) == (
        "shred", "tenant", "acme", 1, "queued")
    assert job["rotated_to"] is None  # v1 was retired: nothing to rotate
    assert DataKey.objects.get(tenant=tenant, version=1).state == "retired"  # until the job's step 1

    job_execute(job_id=job["id"])

    key = DataKey.objects.get(tenant=tenant, version=1)
    assert key.state == "shredded" and key.wrapped is None and key.shredded_at is not None
    dk = data_key_for_worker(tenant)
    assert dk["version"] == 2 and [r["version"] for r in dk["readable"]] == [2] and dk["shredded"] == [1]
    done = admin_client.get(f"/api/admin/flush-jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and "keys_deleted" in [s["step"] for s in done["steps"]]
    assert [(k["version"], k["state"]) for k in admin_client.get(URL).json()] == [(1, "shredded"), (2, "active")]
    # Nothing in the database can be unwrapped as version 1 any more: no row of any table holds it.
    _assert_absent(_database_dump(), old_wrapped)
    event = audit_events("data_key.shred")[-1]
    assert event.new_value == {"version": 1, "state": "shredded", "job": job["id"]}


@pytest.mark.django_db
def test_shredding_the_active_version_rotates_first(admin_client, tenant):
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.selectors import data_key_for_worker

    data_key_for_worker(tenant)
    resp = admin_client.delete(f"{URL}/1")
    assert resp.status_code == 202 and resp.json()["rotated_to"] == 2
    assert data_key_for_worker(tenant)["version"] == 2  # new objects never use the doomed version
    job_execute(job_id=resp.json()["id"])
    assert [(k["version"], k["state"]) for k in admin_client.get(URL).json()] == [(1, "shredded"), (2, "active")]
    rotate = audit_events("data_key.rotate")[-1]
    assert rotate.new_value["version"] == 2 and "shredding v1" in rotate.reason
    # shredding a version already shredded is safe: a new job that only re-checks everywhere
    again = admin_client.delete(f"{URL}/1")
    assert again.status_code == 202 and again.json()["rotated_to"] is None
    assert job_execute(job_id=again.json()["id"]).status == "succeeded"
    assert len(audit_events("data_key.shred")) == 1


@pytest.mark.django_db
def test_audit_events_of_data_keys_carry_no_key_material(admin_client, tenant):
    from controlplane.audit.models import AuditEvent
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.selectors import data_key_for_worker

    data_key_for_worker(tenant)
    post(admin_client, f"{URL}/rotate")
    secrets_ = [_wrapped(tenant, v) for v in (1, 2)]
    secrets_ += [_unwrap(tenant, v, w) for v, w in zip((1, 2), secrets_, strict=True)]
    job_execute(job_id=admin_client.delete(f"{URL}/1").json()["id"])
    events = AuditEvent.objects.filter(action__startswith="data_key.") | AuditEvent.objects.filter(
        action__startswith="shred.")
    assert {e.action for e in events} >= {"data_key.create", "data_key.rotate", "shred.request", "data_key.shred",
                                          "shred.complete"}
    blob = json.dumps([[e.old, e.new, e.reason, e.target] for e in AuditEvent.objects.all()]).encode()
    _assert_absent(blob, *secrets_)
    for e in events:
        for value in (e.old_value or {}, e.new_value or {}):
            assert not {k for k in value if "key" in k.lower() and k != "keys_revoked"}, value


@pytest.mark.django_db
def test_offboarding_shreds_every_version(admin_client, tenant):
    from controlplane.common.errors import Conflict
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.models import DataKey
    from controlplane.tenants.selectors import data_key_for_worker

    data_key_for_worker(tenant)
    post(admin_client, f"{URL}/rotate")
    post(admin_client, f"{URL}/rotate")
    resp = admin_client.delete("/api/admin/tenants/acme?reason=contract%20ended")
    assert resp.status_code == 200
    assert audit_events("tenant.offboard")[-1].new_value["data_key_versions"] == [1, 2, 3]
    job = job_execute(job_id=resp.json()["flush_job"]["id"])
    assert job.kind == "offboard" and job.status == "succeeded"
    assert list(DataKey.objects.filter(tenant=tenant).values_list("state", "wrapped")) == [("shredded", None)] * 3
    assert [e.new_value["version"] for e in audit_events("data_key.shred")] == [1, 2, 3]
    with pytest.raises(Conflict):
        data_key_for_worker(tenant)  # an offboarded tenant never gets a key again


@pytest.mark.django_db
def test_the_worker_view_is_cached_briefly_and_costs_one_query(tenant, settings, django_assert_num_queries,
                                                               monkeypatch):
    from controlplane.tenants import datakeys, keystore

    settings.STRATA_DATA_KEY_CACHE_SECONDS = 30
    datakeys.data_key_for_worker(tenant)  # creates v1
    datakeys.invalidate(tenant.pk)
    with django_assert_num_queries(1):
        first = datakeys.data_key_for_worker(tenant)
    with django_assert_num_queries(0):
        assert datakeys.data_key_for_worker(tenant) is first
    clock = [keystore.time.monotonic() + 31]
    monkeypatch.setattr(keystore.time, "monotonic", lambda: clock[0])
    with django_assert_num_queries(1):  # expired
        datakeys.data_key_for_worker(tenant)


# ---------------------------------------------------------------------- SQLite: gone from the file too
@pytest.mark.django_db(transaction=True)
def test_a_shredded_key_is_not_left_in_the_sqlite_file(tenant, actor, settings):
    from django.db import connection

    from controlplane.tenants.datakeys import data_key_destroy, data_key_for_worker, data_key_rotate

    if connection.vendor != "sqlite":
        pytest.skip("checks the SQLite file itself (PostgreSQL keeps dead rows until VACUUM: see README)")
    data_key_for_worker(tenant)
    data_key_rotate(actor=actor, tenant=tenant)
    old = _wrapped(tenant, 1)
    data_key_destroy(actor=actor, tenant=tenant, versions=[1])
    path = connection.settings_dict["NAME"]
    blob = b"".join(Path(p).read_bytes() for p in (path, path + "-wal") if os.path.exists(p))
    assert _wrapped(tenant, 2) in blob  # the check can see keys that are there...
    _assert_absent(blob, old)  # ...and the shredded one is not


def _database_dump() -> bytes:
    """Every value of every row of every table, as bytes (what someone holding the database has)."""
    from django.apps import apps

    out = []
    for model in apps.get_models():
        for row in model.objects.values_list():
            for value in row:
                out.append(bytes(value) if isinstance(value, bytes | memoryview) else str(value).encode())
    return b"\x00".join(out)


# ---------------------------------------------------------------------- cache policy
@pytest.mark.django_db
def test_cache_policy_defaults_patch_and_audit(admin_client, tenant):
    body = admin_client.get("/api/admin/tenants/acme").json()
    assert body["cache_policy"] == {"persist": True, "retention_seconds": 86400}
    resp = patch(admin_client, "/api/admin/tenants/acme", {"cache_policy": {"persist": False}})
    assert resp.status_code == 200 and resp.json()["cache_policy"] == {"persist": False, "retention_seconds": 86400}
    patch(admin_client, "/api/admin/tenants/acme", {"cache_policy": {"retention_seconds": 3600}, "reason": "gdpr"})
    assert admin_client.get("/api/admin/tenants/acme").json()["cache_policy"] == {
        "persist": False, "retention_seconds": 3600}
    events = audit_events("tenant.cache_policy")
    assert [(e.old_value, e.new_value) for e in events] == [
        ({"persist": True, "retention_seconds": 86400}, {"persist": False, "retention_seconds": 86400}),
        ({"persist": False, "retention_seconds": 86400}, {"persist": False, "retention_seconds": 3600}),
    ]
    assert events[-1].reason == "gdpr"
    patch(admin_client, "/api/admin/tenants/acme", {"cache_policy": {"retention_seconds": 3600}})
    assert len(audit_events("tenant.cache_policy")) == 2  # no change, no event
    listed = admin_client.get("/api/admin/tenants").json()
    assert listed[0]["cache_policy"]["retention_seconds"] == 3600


@pytest.mark.django_db
@pytest.mark.parametrize("policy", [
    {"retention_seconds": -1}, {"retention_seconds": 31_536_001}, {"retention_seconds": "60"},
    {"retention_seconds": 1.5}, {"retention_seconds": None}, {"persist": "yes"}, {"persist": 1},
    {"persist": None}, {"ttl": 5},
])
def test_cache_policy_rejects_bad_values_and_changes_nothing(admin_client, tenant, policy):
    resp = patch(admin_client, "/api/admin/tenants/acme", {"cache_policy": policy})
    assert_error(resp, 422)
    assert admin_client.get("/api/admin/tenants/acme").json()["cache_policy"] == {
        "persist": True, "retention_seconds": 86400}
    assert audit_events("tenant.cache_policy") == []


@pytest.mark.django_db
def test_cache_policy_edges_are_accepted_and_viewers_cannot_patch(admin_client, viewer_client, tenant):
    for value in (0, 31_536_000):
        resp = patch(admin_client, "/api/admin/tenants/acme", {"cache_policy": {"retention_seconds": value}})
        assert resp.json()["cache_policy"]["retention_seconds"] == value
    assert_error(patch(viewer_client, "/api/admin/tenants/acme", {"cache_policy": {"persist": False}}), 403)


# ---------------------------------------------------------------------- the worker request
@pytest.fixture
def served(db, actor, tenant, model):
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create

    grant_create(actor=actor, tenant=tenant, deployment=model)
    return api_key_create(actor=actor, tenant=tenant)[1]


def _worker_req(key: str, **body) -> dict:
    from django.test import RequestFactory

    from controlplane.serving.context import _prepare
    from controlplane.serving.schemas import CompletionRequest

    request = RequestFactory().post("/v1/completions", data=json.dumps({"model": "tiny-llama", "prompt": "hi",
                                                                        "max_tokens": 1, **body}),
                                    content_type="application/json", headers={"Authorization": f"Bearer {key}"})
    return _prepare(request, CompletionRequest).worker_req


@pytest.mark.django_db
def test_worker_request_carries_policy_and_data_keys(served, tenant, actor):
    from controlplane.tenants.datakeys import data_key_rotate
    from controlplane.tenants.services import tenant_update

    req = _worker_req(served)
    assert req["persist"] is True and req["retention_seconds"] == 86400
    dk = req["data_key"]
    assert dk["version"] == 1 and len(_unwrap(tenant, 1, dk["wrapped"])) == 32
    assert _worker_req(served, prompt_cache_retention="in_memory")["persist"] is False
    assert _worker_req(served, prompt_cache_retention="24h")["persist"] is True
    tenant_update(actor=actor, tenant=tenant, cache_policy={"retention_seconds": 7 * 86400})
    assert _worker_req(served)["retention_seconds"] == 7 * 86400
    narrowed = _worker_req(served, prompt_cache_retention="24h")
    assert narrowed["retention_seconds"] == 86400  # narrowed
    assert narrowed["tenant_retention_seconds"] == 7 * 86400  # the tenant's own, for the worker's sweep
    tenant_update(actor=actor, tenant=tenant, cache_policy={"persist": False})
    assert _worker_req(served, prompt_cache_retention="24h")["persist"] is False  # the tenant forbids it
    tenant_update(actor=actor, tenant=tenant, cache_policy={"persist": True, "retention_seconds": 0})
    assert _worker_req(served)["persist"] is False  # nothing may be kept: nothing is written
    data_key_rotate(actor=actor, tenant=tenant)
    assert _worker_req(served)["data_key"]["version"] == 2


# ---------------------------------------------------------------------- master key
def _env(tmp_path, **variables):
    from controlplane import env as envmod

    return envmod.load({"STRATA_HOME": str(tmp_path / "home"), **variables})


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_master_key_file_is_created_0600_once_and_reused(tmp_path):
    from controlplane.common.masterkey import load_master_key

    old = os.umask(0o022)
    try:
        key = load_master_key(_env(tmp_path))
    finally:
        os.umask(old)
    path = tmp_path / "home" / "master.key"
    assert len(key) == 32 and path.read_bytes() == key
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert load_master_key(_env(tmp_path)) == key


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_master_key_file_others_may_read_is_refused(tmp_path, mode):
    from controlplane.common.masterkey import MasterKeyError, load_master_key

    load_master_key(_env(tmp_path))
    path = tmp_path / "home" / "master.key"
    path.chmod(mode)
    with pytest.raises(MasterKeyError, match="chmod 600"):
        load_master_key(_env(tmp_path))


def test_explicit_master_key_file_and_variable(tmp_path):
    from controlplane.common.masterkey import MasterKeyError, load_master_key

    missing = tmp_path / "secrets" / "master.key"
    with pytest.raises(MasterKeyError, match="does not exist"):
        load_master_key(_env(tmp_path, STRATA_MASTER_KEY_FILE=str(missing)))
    assert not missing.exists()  # an explicit key is never invented
    missing.parent.mkdir()
    key = os.urandom(32)
    missing.write_text(base64.b64encode(key).decode() + "\n")  # base64 text, as secret stores hand it
    missing.chmod(0o400)
    assert load_master_key(_env(tmp_path, STRATA_MASTER_KEY_FILE=str(missing))) == key
    assert load_master_key(_env(tmp_path, STRATA_MASTER_KEY=base64.b64encode(key).decode())) == key
    for bad in ("not base64!", base64.b64encode(os.urandom(16)).decode()):
        with pytest.raises(MasterKeyError):
            load_master_key(_env(tmp_path, STRATA_MASTER_KEY=bad))
    with pytest.raises(MasterKeyError, match="only one"):
        load_master_key(_env(tmp_path, STRATA_MASTER_KEY=base64.b64encode(key).decode(),
                             STRATA_MASTER_KEY_FILE=str(missing)))
    assert not (tmp_path / "home" / "master.key").exists()


def test_launcher_creates_the_master_key_and_points_every_child_at_it(tmp_path, monkeypatch):
    from workers.launcher import Config, Launcher, LaunchError

    for name in ("STRATA_MASTER_KEY", "STRATA_MASTER_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    launcher = Launcher(Config(home=home, port=1, demo=False, verbose=False, ray_address=None))
    launcher.master_key()
    assert launcher.env["STRATA_MASTER_KEY_FILE"] == str(home / "master.key")
    assert _mode(home / "master.key") == 0o600
    (home / "master.key").chmod(0o644)
    again = Launcher(Config(home=home, port=1, demo=False, verbose=False, ray_address=None))
    with pytest.raises(LaunchError, match="chmod 600"):
        again.master_key()
