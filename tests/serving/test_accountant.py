"""The accountant accounts requests that wait together in one transaction (one commit), and a request
whose accounting fails loses only its own writes (``serving.accountant``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_account(monkeypatch):
    """``accounting.account`` replaced: each request creates a tenant named by its ``prep`` and notes
    whether it ran inside a transaction; ``finished == "fail"`` raises after its write; ``"close"``
    closes the thread's connection (so no connection outlives the test)."""
    from django.db import connection

    from controlplane.serving import accounting
    from controlplane.tenants.models import Tenant

    seen: dict[str, bool] = {}

    def account(prep, finished, ledger=None):
        if finished == "close":
            connection.close()
            return None
        Tenant.objects.create(slug=prep, name=prep)
        seen[prep] = connection.in_atomic_block
        if finished == "fail":
            raise RuntimeError("accounting failed on purpose")
        return None

    monkeypatch.setattr(accounting, "account", account)
    return seen


def test_waiting_requests_are_accounted_in_one_transaction_and_a_failure_loses_only_its_own(transactional_db,
                                                                                           fake_account):
    from controlplane.serving.accountant import Accountant
    from controlplane.tenants.models import Tenant

    accountant = Accountant()
    for slug, how in (("a1", "ok"), ("b1", "fail"), ("c1", "ok")):
        accountant.submit(slug, how)  # queued before the thread starts: they wait together
    accountant.start()
    assert accountant.drain()
    assert set(Tenant.objects.values_list("slug", flat=True)) == {"a1", "c1"}  # b1's write rolled back
    assert fake_account == {"a1": True, "b1": True, "c1": True}  # all three in the batch's transaction
    accountant.submit("d1", "ok")  # alone: no transaction of its own needed
    assert accountant.drain()
    assert fake_account["d1"] is False and Tenant.objects.filter(slug="d1").exists()
    accountant.submit("-", "close")
    assert accountant.drain()


def test_a_batch_writes_its_ledger_records_together_and_a_drain_ends_the_gathering(transactional_db, monkeypatch):
    """Requests accounted together hand their ledger records to one ``ledger_record_many`` call; the
    batch gathers what arrives behind its first request, and a ``drain`` ends that wait at once."""
    from controlplane.ledger import services as ledger_services
    from controlplane.serving import accountant as accountant_module
    from controlplane.serving import accounting
    from controlplane.serving.accountant import Accountant

    calls: list[list[dict]] = []
    monkeypatch.setattr(accounting, "account", lambda prep, finished, ledger=None: ledger.append({"prep": prep}))
    monkeypatch.setattr(ledger_services, "ledger_record_many", lambda records: calls.append(list(records)))
    monkeypatch.setattr(accountant_module, "GATHER_S", 60.0)  # only the drain can end this batch's wait
    accountant = Accountant()
    accountant.start()
    accountant.submit("a", {})
    accountant.submit("b", {})
    assert accountant.drain(timeout=30)
    assert calls == [[{"prep": "a"}, {"prep": "b"}]]


def test_ledger_record_many_adds_up_per_tenant_and_model_in_one_update_each(transactional_db):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from controlplane.common.actor import Actor
    from controlplane.ledger.models import LedgerHour
    from controlplane.ledger.services import ledger_record_many
    from controlplane.tenants.services import tenant_create

    a, b = (tenant_create(actor=Actor.system("test"), slug=s, name=s) for s in ("ta", "tb"))
    usage = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
    ledger_record_many([{"tenant_id": a.pk, "model": "m", "usage": usage}])  # the hour's row exists now
    records = [{"tenant_id": a.pk, "model": "m", "usage": usage, "misses": {"evicted": 2}},
               {"tenant_id": a.pk, "model": "m", "usage": usage},
               {"tenant_id": b.pk, "model": "m", "usage": usage}]
    with CaptureQueriesContext(connection) as queries:
        ledger_record_many(records)
    updates = [q for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 2  # one per tenant and model (tenant b then inserts its first row of the hour)
    row = LedgerHour.objects.get(tenant=a, model="m")
    assert (row.requests, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (3, 30, 24, 6)
    assert LedgerHour.objects.get(tenant=b, model="m").requests == 1
