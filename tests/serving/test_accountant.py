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

    def account(prep, finished):
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
