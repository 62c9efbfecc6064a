"""The audit chain verified on a schedule (``controlplane.audit.checks``) and its last result on
/metrics, which the StrataAuditChainBroken / StrataAuditVerificationStale alerts read: one claim per
interval across processes, a broken chain recorded as ``strata_audit_verify_ok 0`` (and counted), the
series absent before any run, ``manage.py audit_verify`` recording too, and a real Celery worker
verifying the chain as soon as it starts."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from tests.live_db import database_url

pytestmark = pytest.mark.django_db
REPO = Path(__file__).resolve().parents[2]


def record(n, actor):
    from controlplane.audit.services import audit_record

    return [audit_record(actor=actor, action="test.event", target=f"t{i}", new={"i": i}) for i in range(n)]


def rewind_head(to_seq: int) -> None:
    """Rewind the chain head behind the triggers' back, as a database superuser could."""
    from controlplane.audit import triggers
    from controlplane.audit.models import AuditEvent

    head = AuditEvent.objects.get(seq=to_seq).hash
    with triggers.suspended(connection), connection.cursor() as cursor:
        cursor.execute("UPDATE audit_audithead SET seq = %s, hash = %s", [to_seq, head])


def audit_series(client) -> dict[str, float]:
    text = client.get("/metrics").content.decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("strata_audit_verify")}


def test_one_claim_per_interval_whoever_asks():
    from controlplane.audit.checks import audit_check_claim

    now = timezone.now()
    assert audit_check_claim(interval_seconds=3600, now=now)  # never run: due
    assert not audit_check_claim(interval_seconds=3600, now=now)  # a second process, same moment
    assert not audit_check_claim(interval_seconds=3600, now=now + timedelta(seconds=3599))
    assert audit_check_claim(interval_seconds=3600, now=now + timedelta(seconds=3600))


def test_run_due_verifies_only_when_its_claim_wins(actor, settings):
    from controlplane.audit.checks import audit_check_status, run_due

    settings.STRATA_AUDIT_CHECK_SECONDS = 3600
    record(3, actor)
    assert audit_check_status() is None
    assert run_due()
    first = audit_check_status()
    assert first["ok"] and first["length"] == 3 and first["failures"] == 0
    assert not run_due()  # claimed a moment ago: not due for an hour
    assert audit_check_status()["checked_at"] == first["checked_at"]


def test_metrics_report_a_passing_then_a_broken_chain_and_count_the_failure(actor, admin_client):
    from controlplane.audit.checks import audit_check_run

    record(4, actor)
    assert audit_series(admin_client) == {}  # never verified: absent (StrataAuditNeverVerified reads that)
    before = time.time()
    assert audit_check_run()["ok"]
    series = audit_series(admin_client)
    assert series["strata_audit_verify_ok"] == 1.0 and series["strata_audit_verify_failures_total"] == 0.0
    assert before - 1 <= series["strata_audit_verify_timestamp_seconds"] <= time.time() + 1
    rewind_head(2)
    result = audit_check_run()
    assert (result["ok"], result["first_bad"]) == (False, 3)
    series = audit_series(admin_client)
    assert series["strata_audit_verify_ok"] == 0.0 and series["strata_audit_verify_failures_total"] == 1.0


def test_the_command_records_its_result_too(actor):
    from controlplane.audit.checks import audit_check_status

    record(3, actor)
    call_command("audit_verify", stdout=io.StringIO())
    assert audit_check_status()["ok"]
    rewind_head(1)
    with pytest.raises(CommandError, match="seq 2"):
        call_command("audit_verify", stdout=io.StringIO())
    status = audit_check_status()
    assert (status["ok"], status["first_bad"], status["failures"]) == (False, 2, 1)
    assert "rewound" in status["problem"]


@pytest.mark.django_db(transaction=True)
def test_a_celery_worker_verifies_the_chain_when_it_starts(actor, settings, tmp_path):
    """The wiring: the check thread starts with a real Celery worker (``worker_ready``), claims the
    never-run check at once and records it in the database the test process reads."""
    from controlplane.audit.checks import audit_check_status

    record(2, actor)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.test_worker",
           "DATABASE_URL": database_url(), "STRATA_TEST_CELERY_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    if settings.CELERY_BROKER_URL:
        env["CELERY_BROKER_URL"] = settings.CELERY_BROKER_URL
    log = tmp_path / "celery.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "controlplane.celery_app", "worker", "--pool", "threads",
         "--concurrency", "1", "--loglevel", "info", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        env=env, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while audit_check_status() is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)
        status = audit_check_status()
        assert status is not None, f"no verification recorded; worker log:\n{log.read_text()[-3000:]}"
        assert status["ok"] and status["length"] == 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
