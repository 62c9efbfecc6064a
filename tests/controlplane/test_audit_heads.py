"""Audit hardening: the chain is an HMAC keyed outside the database, the head row only moves forward
(the database refuses anything else, REPLACE included), and the head is also kept outside the
database (an append-only file and a Prometheus gauge), so a truncated tail with the head rewound to
match is still found and named by seq. Runs on SQLite and on PostgreSQL (``DATABASE_URL``)."""

import hashlib
import hmac
import io
import json
import stat

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from tests.controlplane.helpers import audit_actions

pytestmark = pytest.mark.django_db
GENESIS = "0" * 64


@pytest.fixture
def head_log(settings, tmp_path):
    """The external head log, redirected to a file of this test's own."""
    path = tmp_path / "audit-head.log"
    settings.STRATA_AUDIT_HEAD_LOG = str(path)
    return path


def record(n, actor):
    from controlplane.audit.services import audit_record

    return [audit_record(actor=actor, action="test.event", target=f"t{i}", new={"i": i}) for i in range(n)]


def verify():
    from controlplane.audit.selectors import audit_verify

    return audit_verify()


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def tamper(sql, params=()):
    """Run ``sql`` with every audit trigger dropped, as a database superuser could."""
    from controlplane.audit import triggers

    with triggers.suspended(connection), connection.cursor() as cursor:
        cursor.execute(sql, params)


# ---------------------------------------------------------------------- 1. keyed hash
def test_the_hash_is_an_hmac_under_the_audit_key_not_a_plain_digest(actor, settings):
    from controlplane.audit.chain import audit_key, canonical_encoding

    settings.STRATA_AUDIT_KEY = "k" * 43
    event = record(1, actor)[0]
    encoding = canonical_encoding(event)
    assert audit_key() == b"k" * 43
    assert event.hash == hmac.new(b"k" * 43, encoding, hashlib.sha256).hexdigest()
    assert event.hash != hashlib.sha256(encoding).hexdigest()
    assert verify()["ok"]
    settings.STRATA_AUDIT_KEY = "a different key"  # a verifier (or forger) without the key
    assert (verify()["ok"], verify()["first_bad"]) == (False, 1)


def test_a_record_rehashed_without_the_key_is_named(actor):
    from controlplane.audit.chain import canonical_encoding
    from controlplane.audit.models import AuditEvent

    record(4, actor)
    forged = AuditEvent.objects.get(seq=4)
    forged.reason = "forged"
    tamper("UPDATE audit_auditevent SET reason = %s, hash = %s WHERE seq = 4",
           ["forged", hashlib.sha256(canonical_encoding(forged)).hexdigest()])
    assert (verify()["ok"], verify()["first_bad"]) == (False, 4)


def test_the_key_file_is_made_0600_on_first_use_and_the_environment_can_supply_the_key(
        settings, tmp_path, monkeypatch):
    from controlplane import env
    from controlplane.audit.chain import audit_key

    settings.STRATA_AUDIT_KEY, settings.STRATA_AUDIT_KEY_FILE = None, tmp_path / "audit.key"
    key = audit_key()
    assert len(key) >= 43 and (tmp_path / "audit.key").read_text().strip().encode() == key
    assert stat.S_IMODE((tmp_path / "audit.key").stat().st_mode) == 0o600
    assert audit_key() == key
    monkeypatch.setenv("STRATA_AUDIT_KEY", "from-the-environment")
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    loaded = env.load()
    assert loaded.audit_key == "from-the-environment"
    assert loaded.audit_key_file == tmp_path / "home" / "audit.key"


# ---------------------------------------------------------------------- 2. the head row
def test_the_database_refuses_to_delete_or_rewind_the_head_and_allows_a_forward_move(actor):
    from controlplane.audit.models import AuditHead

    record(3, actor)
    attempts = [
        lambda: AuditHead.objects.all().delete(),
        lambda: AuditHead.objects.filter(pk=1).update(seq=2),
        lambda: AuditHead.objects.filter(pk=1).update(seq=3, hash=GENESIS),
        lambda: AuditHead.objects.filter(pk=1).update(id=2, seq=9),
        lambda: connection.cursor().execute("DELETE FROM audit_audithead"),
        lambda: connection.cursor().execute("UPDATE audit_audithead SET seq = 0"),
    ]
    if connection.vendor == "postgresql":
        attempts.append(lambda: connection.cursor().execute("TRUNCATE audit_audithead"))
    for attempt in attempts:
        with pytest.raises(DatabaseError, match="only moves forward"), transaction.atomic():
            attempt()
    assert AuditHead.objects.get().seq == 3
    with transaction.atomic():  # what every append does; rolled back here
        AuditHead.objects.filter(pk=1).update(seq=4)
        transaction.set_rollback(True)
    assert verify()["ok"]


@pytest.mark.skipif("connection.vendor != 'sqlite'")
@pytest.mark.parametrize("sql", [
    "INSERT OR REPLACE INTO audit_audithead (id, seq, hash) VALUES (1, 1, '{genesis}')",
    "REPLACE INTO audit_audithead (id, seq, hash) VALUES (1, 0, '{genesis}')",
    "INSERT OR REPLACE INTO audit_auditevent SELECT seq, time, 'mallory', auth_method, source, action, target, "
    "tenant, old, new, reason, result, prev_hash, hash, peer, forwarded_for FROM audit_auditevent WHERE seq = 2",
    "INSERT OR REPLACE INTO audit_auditevent SELECT 99, time, actor, auth_method, source, action, target, "
    "tenant, old, new, reason, result, prev_hash, hash, peer, forwarded_for FROM audit_auditevent WHERE seq = 3",
])
def test_sqlite_refuses_insert_or_replace_over_an_event_or_the_head(actor, sql):
    from controlplane.audit import triggers

    sql = sql.format(genesis=GENESIS)
    record(3, actor)
    with pytest.raises(DatabaseError, match="refused"), transaction.atomic():
        connection.cursor().execute(sql)
    assert verify()["ok"]
    # The attack the trigger stops: REPLACE deletes the conflicting row without a DELETE trigger.
    with transaction.atomic():
        with triggers.suspended(connection):
            connection.cursor().execute(sql)
        assert not verify()["ok"]
        transaction.set_rollback(True)


def test_a_missing_head_fails_verify_naming_the_last_record(actor):
    record(4, actor)
    tamper("DELETE FROM audit_audithead")
    result = verify()
    assert (result["ok"], result["first_bad"], result["length"]) == (False, 4, 4)
    assert "missing" in result["problem"]


def test_a_rewound_head_fails_verify_in_the_selector_the_api_and_the_command(actor, admin_client):
    from controlplane.audit.models import AuditEvent

    record(5, actor)
    total = AuditEvent.objects.count()
    tamper("UPDATE audit_audithead SET seq = 2, hash = %s", [AuditEvent.objects.get(seq=2).hash])
    result = verify()
    assert (result["ok"], result["first_bad"]) == (False, 3) and "rewound" in result["problem"]
    api = admin_client.get("/api/admin/audit/verify").json()
    assert (api["ok"], api["first_bad"], api["length"]) == (False, 3, total)
    with pytest.raises(CommandError, match="seq 3"):
        call_command("audit_verify", stdout=io.StringIO())


def test_an_append_after_the_head_was_removed_records_the_incident_in_the_chain(actor):
    from controlplane.audit.models import AuditEvent

    record(3, actor)
    tamper("DELETE FROM audit_audithead")
    record(1, actor)
    restored = AuditEvent.objects.get(seq=4)
    assert (restored.action, restored.result, restored.new_value["seq"]) == ("audit.head_restored", "error", 3)
    assert audit_actions()[-1] == "test.event" and verify()["ok"]


# ---------------------------------------------------------------------- 3. the head outside the database
@pytest.mark.django_db(transaction=True)
def test_a_truncated_tail_with_the_head_rewound_to_match_is_found_through_the_head_log(actor, head_log):
    from controlplane.audit.models import AuditEvent

    events = record(6, actor)  # six committed appends: six lines
    assert [(line["seq"], line["hash"]) for line in lines(head_log)] == [(e.seq, e.hash) for e in events]
    assert stat.S_IMODE(head_log.stat().st_mode) == 0o600
    # Behind the app's back: drop the triggers, delete the tail, rewind the head to the new end.
    tamper("DELETE FROM audit_auditevent WHERE seq > 3")
    tamper("UPDATE audit_audithead SET seq = 3, hash = %s", [AuditEvent.objects.get(seq=3).hash])
    result = verify()
    assert (result["ok"], result["first_bad"], result["length"]) == (False, 4, 3)
    assert "external head log" in result["problem"]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_append_does_not_advance_the_head_log(actor, head_log):
    from controlplane.audit.services import audit_record

    record(2, actor)
    with pytest.raises(RuntimeError), transaction.atomic():
        audit_record(actor=actor, action="test.rolled_back")
        raise RuntimeError("the change it describes failed")
    assert [line["seq"] for line in lines(head_log)] == [1, 2]
    assert verify()["ok"] and audit_actions() == ["test.event", "test.event"]


def test_a_lagging_head_log_is_tolerated_but_a_wrong_hash_in_it_is_named(actor, head_log):
    from controlplane.audit.headlog import head_log_append

    events = record(5, actor)  # inside the test transaction: nothing written yet
    assert not head_log.exists() and verify()["ok"]
    head_log_append(seq=3, hash=events[2].hash)  # the file may lag (a write lost after commit)
    assert verify()["ok"]
    head_log_append(seq=4, hash="f" * 64)
    result = verify()
    assert (result["ok"], result["first_bad"]) == (False, 4)
    head_log_append(seq=0, hash=GENESIS, kind="reset")  # only what follows a reset counts
    assert verify()["ok"]


@pytest.mark.django_db(transaction=True)
def test_the_test_flush_writes_a_reset_line_so_the_emptied_log_verifies(actor, head_log):
    record(3, actor)
    call_command("flush", interactive=False, verbosity=0)
    assert [(line["seq"], line["kind"]) for line in lines(head_log)][-2:] == [(3, "append"), (0, "reset")]
    record(1, actor)
    assert verify()["ok"] and verify()["length"] == 1


def test_metrics_show_both_heads_as_a_gauge(actor, admin_client, head_log):
    from controlplane.audit.headlog import head_log_append

    events = record(3, actor)
    head_log_append(seq=events[1].seq, hash=events[1].hash)  # the file lags by one
    text = admin_client.get("/metrics").content.decode()
    assert f'strata_audit_head_seq{{store="database"}} {float(events[2].seq)}' in text
    assert f'strata_audit_head_seq{{store="file"}} {float(events[1].seq)}' in text
