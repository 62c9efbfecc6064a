"""Audit log: every admin change appends; the chain verifies; the database refuses edits; tampering
behind the triggers' back is found and named by seq."""

import io
import threading
import time
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from tests.controlplane.helpers import audit_actions, patch, post

pytestmark = pytest.mark.django_db


def record(n, actor):
    from controlplane.audit.services import audit_record

    for i in range(n):
        audit_record(actor=actor, action="test.event", target=f"t{i}", new={"i": i})


def verify():
    from controlplane.audit.selectors import audit_verify

    return audit_verify()


def test_every_admin_action_appends_one_event_and_the_chain_verifies(admin_client, model):
    start = len(audit_actions())
    post(admin_client, "/api/admin/tenants", {"slug": "acme", "name": "Acme"})
    patch(admin_client, "/api/admin/tenants/acme", {"quotas": {"requests_per_minute": 5}})
    key_id = post(admin_client, "/api/admin/tenants/acme/keys", {}).json()["id"]
    admin_client.delete(f"/api/admin/tenants/acme/keys/{key_id}")
    post(admin_client, "/api/admin/tenants/acme/grants", {"model": "tiny-llama"})
    post(admin_client, "/api/admin/models/tiny-llama/revisions", {"label": "r2", "seed": 1})
    post(admin_client, "/api/admin/share-groups", {"slug": "team", "name": "Team"})
    patch(admin_client, "/api/admin/tenants/acme", {"status": "suspended"})
    admin_client.delete("/api/admin/tenants/acme")
    actions = audit_actions()[start:]
    assert "offboard.request" in actions  # the jobs app audits the offboarding flush job it queues
    assert [a for a in actions if a != "offboard.request"] == [
        "tenant.create", "tenant.quotas", "key.create", "key.revoke", "grant.create", "revision.create",
        "share_group.create", "tenant.suspend", "tenant.offboard",
    ]
    result = admin_client.get("/api/admin/audit/verify").json()
    assert result["ok"] is True and result["first_bad"] is None
    assert result["length"] == len(audit_actions())


def test_chain_links_each_event_to_the_previous_hash(actor):
    from controlplane.audit.chain import event_hash
    from controlplane.audit.models import GENESIS_HASH, AuditEvent

    record(3, actor)
    events = list(AuditEvent.objects.order_by("seq"))
    assert [e.seq for e in events] == [1, 2, 3]
    assert events[0].prev_hash == GENESIS_HASH
    assert [e.prev_hash for e in events[1:]] == [e.hash for e in events[:-1]]
    assert all(event_hash(e) == e.hash for e in events)
    assert verify() == {"ok": True, "length": 3, "head": events[-1].hash, "first_bad": None, "problem": None}


def test_orm_and_raw_sql_update_and_delete_are_refused_by_the_database(actor):
    from controlplane.audit.models import AuditEvent

    record(2, actor)
    attempts = [
        lambda: AuditEvent.objects.filter(seq=1).update(actor="mallory"),
        lambda: AuditEvent.objects.filter(seq=2).delete(),
        lambda: AuditEvent.objects.get(seq=1).delete(),
        lambda: connection.cursor().execute("UPDATE audit_auditevent SET reason = 'x' WHERE seq = 1"),
        lambda: connection.cursor().execute("DELETE FROM audit_auditevent"),
    ]
    for attempt in attempts:
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            attempt()
    assert AuditEvent.objects.count() == 2 and AuditEvent.objects.get(seq=1).actor == actor.name
    assert verify()["ok"]


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_truncate_is_refused_on_postgresql(actor):
    record(1, actor)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        connection.cursor().execute("TRUNCATE audit_auditevent")


def test_edit_behind_the_triggers_back_is_found_at_exactly_that_seq(actor):
    from controlplane.audit import triggers

    record(10, actor)
    assert verify()["ok"]
    triggers.uninstall(connection)  # rolled back with the test transaction
    with connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditevent SET reason = 'rewritten' WHERE seq = 6")
    result = verify()
    assert result["ok"] is False and result["first_bad"] == 6 and result["length"] == 10


def test_deleted_record_is_named_by_its_missing_seq(actor):
    from controlplane.audit import triggers

    record(5, actor)
    triggers.uninstall(connection)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM audit_auditevent WHERE seq = 3")
    result = verify()
    assert (result["ok"], result["first_bad"], result["length"]) == (False, 3, 4)


def test_rehashed_record_breaks_the_next_link(actor):
    from controlplane.audit import triggers
    from controlplane.audit.chain import event_hash
    from controlplane.audit.models import AuditEvent

    record(5, actor)
    forged = AuditEvent.objects.get(seq=2)
    forged.reason = "forged"
    triggers.uninstall(connection)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditevent SET reason = %s, hash = %s WHERE seq = 2",
                       ["forged", event_hash(forged)])
    assert verify()["first_bad"] == 3


def test_truncated_tail_is_detected_through_the_chain_head(actor):
    from controlplane.audit import triggers

    record(4, actor)
    triggers.uninstall(connection)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM audit_auditevent WHERE seq = 4")
    result = verify()
    assert (result["ok"], result["first_bad"], result["length"]) == (False, 4, 3)


def test_audit_values_refuse_secret_fields_and_bytes(actor):
    from controlplane.audit.services import AuditSecretError, audit_record

    for bad in [{"key": "sk-st-x"}, {"nested": {"scope_salt": "00"}}, {"prompt": "hi"}, {"blob": b"\x00"}]:
        with pytest.raises(AuditSecretError):
            audit_record(actor=actor, action="test.bad", new=bad)
    assert audit_actions() == []
    audit_record(actor=actor, action="test.ok", new={"prefix": "sk-st-abcdefgh"})
    assert audit_actions() == ["test.ok"]


def test_audit_record_accepts_a_plain_actor_name_with_method_and_source():
    from controlplane.audit.services import audit_record

    event = audit_record(actor="system:celery", auth_method="system", source="", action="job.done", target="7")
    assert (event.actor, event.auth_method, event.seq) == ("system:celery", "system", 1)


def test_verify_command_exits_nonzero_on_a_broken_chain(actor):
    from controlplane.audit import triggers

    record(3, actor)
    out = io.StringIO()
    call_command("audit_verify", stdout=out)
    assert '"ok": true' in out.getvalue()
    triggers.uninstall(connection)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditevent SET actor = 'x' WHERE seq = 2")
    with pytest.raises(CommandError, match="seq 2"):
        call_command("audit_verify", stdout=io.StringIO())


def test_audit_api_filters_by_action_actor_tenant_and_time_and_pages(admin_client, actor):
    from controlplane.tenants.services import tenant_create

    tenant_create(actor=actor, slug="t1", name="T1")
    tenant_create(actor=actor, slug="t2", name="T2")
    post(admin_client, "/api/admin/tenants/t1/keys", {})

    def items(query):
        return admin_client.get(f"/api/admin/audit?{query}").json()["items"]

    assert [e["tenant"] for e in items("action=tenant.create")] == ["t2", "t1"]
    assert [e["action"] for e in items("tenant=t1")] == ["key.create", "tenant.create"]
    assert [e["action"] for e in items("actor=admin-op")] == ["key.create"]
    assert {e["action"] for e in items("action=tenant.")} == {"tenant.create"}
    future = (timezone.now() + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    assert items(f"since={future}") == []
    assert len(items(f"until={future}")) == 4  # includes the admin token's own creation
    page = admin_client.get("/api/admin/audit?limit=2").json()
    assert len(page["items"]) == 2 and page["next_before"] == page["items"][-1]["seq"]
    rest = admin_client.get(f"/api/admin/audit?limit=2&before={page['next_before']}").json()
    assert [e["seq"] for e in rest["items"]] == [2, 1] and rest["next_before"] == 1


def build_chain(n, actor):
    """Write a valid n-event chain in bulk (same hash function as the service, without n lock
    round-trips: appending 10,000 events one by one inside a single test transaction would mostly
    measure PostgreSQL walking 10,000 uncommitted versions of the chain-head row)."""
    from controlplane.audit.chain import canonical_json, event_hash
    from controlplane.audit.models import GENESIS_HASH, AuditEvent, AuditHead

    prev, now, events = GENESIS_HASH, timezone.now(), []
    for seq in range(1, n + 1):
        event = AuditEvent(seq=seq, time=now, actor=actor.name, auth_method=actor.auth_method, source="",
                           action="bulk.event", target=f"t{seq}", tenant="", old=None,
                           new=canonical_json({"i": seq}), reason="", result="ok", prev_hash=prev)
        event.hash = prev = event_hash(event)
        events.append(event)
    AuditEvent.objects.bulk_create(events, batch_size=2000)
    AuditHead.objects.update_or_create(pk=1, defaults={"seq": n, "hash": prev})


@pytest.mark.slow
def test_verify_10000_events_streaming(actor, capsys):
    from controlplane.audit.models import AuditEvent

    build_chain(10_000, actor)
    record(1, actor)  # the service continues a chain it did not write itself
    started = time.perf_counter()
    result = verify()
    elapsed = time.perf_counter() - started
    with capsys.disabled():
        print(f"\naudit: verified {result['length']:,} events in {elapsed:.2f}s ({connection.vendor})")
    assert result["ok"] and result["length"] == 10_001 == AuditEvent.objects.count()


@pytest.mark.django_db(transaction=True)
def test_appends_in_separate_transactions_keep_a_valid_chain(actor, capsys):
    started = time.perf_counter()
    record(300, actor)
    elapsed = time.perf_counter() - started
    with capsys.disabled():
        print(f"\naudit: 300 committed appends in {elapsed:.2f}s ({connection.vendor})")
    assert verify()["ok"] and verify()["length"] == 300


@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_from_many_threads_keep_one_chain(actor):
    from django.db import connections

    from controlplane.audit.services import audit_record

    errors = []

    def worker(n):
        try:
            for i in range(10):
                audit_record(actor=actor, action="test.concurrent", target=f"{n}-{i}")
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    result = verify()
    assert result["ok"] and result["length"] == 80


@pytest.mark.django_db(transaction=True)
def test_test_flush_empties_the_log_and_puts_the_triggers_back(actor, settings):
    from controlplane.audit.models import AuditEvent

    record(2, actor)
    settings.STRATA_AUDIT_ALLOW_FLUSH = False
    with pytest.raises(CommandError, match="append-only"):
        call_command("flush", interactive=False, verbosity=0)
    settings.STRATA_AUDIT_ALLOW_FLUSH = True
    call_command("flush", interactive=False, verbosity=0)
    assert AuditEvent.objects.count() == 0
    record(1, actor)
    assert verify() == {"ok": True, "length": 1, "head": AuditEvent.objects.get().hash, "first_bad": None,
                        "problem": None}
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.all().delete()
