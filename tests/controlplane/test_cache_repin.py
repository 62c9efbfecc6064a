"""Named caches' pins follow a replica that started anew (``caches.repin``): the stats poll names
each replica's boot id; a new one gets its model's live pinned caches pinned again, once."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone


@pytest.fixture
def setup(db, actor):
    from controlplane.caches.models import NamedCache
    from controlplane.registry.services import model_create
    from controlplane.tenants.services import tenant_create

    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    model = model_create(actor=actor, name="m1", preset="tiny", revision={"label": "r1", "seed": 1})
    live = NamedCache.objects.create(tenant=tenant, deployment=model, revision="r1", token_ids=[1, 2, 3], tokens=3,
                                     pinned_tokens=16, expires_at=timezone.now() + timedelta(hours=1))
    NamedCache.objects.create(tenant=tenant, deployment=model, revision="r1", tokens=3, pinned_tokens=0,
                              expires_at=timezone.now() + timedelta(hours=1))  # not pinned
    NamedCache.objects.create(tenant=tenant, deployment=model, revision="r1", tokens=3, pinned_tokens=16,
                              expires_at=timezone.now() - timedelta(seconds=1))  # expired
    NamedCache.objects.create(tenant=tenant, deployment=model, revision="r1", tokens=3, pinned_tokens=16,
                              expires_at=timezone.now() + timedelta(hours=1), deleted_at=timezone.now())
    return live


def test_a_replica_with_a_new_boot_id_gets_its_pins_again(setup, monkeypatch):
    from controlplane.caches import repin
    from controlplane.runtime import gateway

    calls = []
    monkeypatch.setattr(gateway, "call", lambda spec, method, *args, **kw: calls.append((method, args, kw)) or {})
    monkeypatch.setattr(repin, "_seen", {})
    poll = [{"model": "m1", "replica": 0, "status": "ok", "worker": {"boot_id": "a"}},
            {"model": "m1", "replica": 1, "status": "unreachable"}]
    assert repin.repin_restarted(poll) == 1  # first sight of replica 0: its live pinned cache
    method, args, kw = calls[0]
    assert method == "cache_pin" and kw["replica"] == 0 and args[0]["prompt"] == [1, 2, 3]
    assert args[1] == pytest.approx(setup.expires_at.timestamp())
    assert repin.repin_restarted(poll) == 0  # same boot: nothing
    poll[0]["worker"]["boot_id"] = "b"  # restarted
    assert repin.repin_restarted(poll) == 1 and len(calls) == 2
