"""``max_pinned_tokens`` holds under concurrent creates (issue 42, item 4): ``caches.services.cache_create``
reads the tenant's room and inserts in one step with the tenant's row locked, so creates racing from
many threads (the tenant's concurrent ``POST /v1/caches``) never pin more than the quota between them.
Against the suite's database (PostgreSQL in CI): each thread has its own connection."""

from __future__ import annotations

import threading

from django.db import connection

THREADS = 8
ROUNDS = 4
PIN = 512


def test_racing_creates_never_pin_more_than_the_quota(transactional_db, actor):
    from controlplane.caches.models import NamedCache
    from controlplane.caches.services import cache_create
    from controlplane.registry.services import model_create
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.services import tenant_create

    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    model = model_create(actor=actor, name="m1", preset="tiny", revision={"label": "r1", "seed": 1})
    errors: list[BaseException] = []

    def create(barrier: threading.Barrier, i: int) -> None:
        try:
            barrier.wait()
            cache_create(tenant=tenant, deployment=model, revision="r1", kind="prompt", token_ids=list(range(PIN)),
                         messages=None, cache_salt=None, display_name=f"racer {i}", ttl_seconds=600, pin_tokens=PIN,
                         tiers={}, key_prefix="sk-test", actor=actor)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)
        finally:
            connection.close()

    for round_ in range(1, ROUNDS + 1):
        # each round leaves room for exactly one more cache's pin
        Tenant.objects.filter(pk=tenant.pk).update(max_pinned_tokens=round_ * PIN)
        barrier = threading.Barrier(THREADS)
        threads = [threading.Thread(target=create, args=(barrier, i)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        pinned = list(NamedCache.objects.filter(tenant=tenant, pinned_tokens__gt=0).values_list("pinned_tokens",
                                                                                              flat=True))
        assert sum(pinned) <= round_ * PIN, f"round {round_}: {len(pinned)} caches pinned {sum(pinned)} tokens"
        assert pinned == [PIN] * round_  # paired: the room there was is used, by one cache a round
    assert NamedCache.objects.filter(tenant=tenant).count() == THREADS * ROUNDS  # every create made its row
