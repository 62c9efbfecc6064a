"""Expired and deleted named caches lose their prompt (issue 42, item 3): ``caches.services.caches_sweep``
clears their token ids and messages (the counts stay: the ledger bills from them), audited once per
sweep in aggregate; the sweep thread runs it every ``STRATA_L3_SWEEP_SECONDS``, the L3 retention
sweep's period; a TTL change cannot bring a swept cache back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.common.errors import NotFound


def _make(tenant, model, *, ttl_s: float, token_ids=(1, 2, 3, 4), messages=None, deleted: bool = False):
    from controlplane.caches.models import NamedCache

    now = timezone.now()
    return NamedCache.objects.create(
        tenant=tenant, deployment=model, revision="r1", kind="messages" if messages else "prompt",
        token_ids=list(token_ids), messages=messages, tokens=len(token_ids), pinned_tokens=16,
        expires_at=now + timedelta(seconds=ttl_s), deleted_at=now if deleted else None)


@pytest.fixture
def setup(actor):
    from controlplane.registry.services import model_create
    from controlplane.tenants.services import tenant_create

    acme = tenant_create(actor=actor, slug="acme", name="Acme")
    globex = tenant_create(actor=actor, slug="globex", name="Globex")
    model = model_create(actor=actor, name="m1", preset="tiny", revision={"label": "r1", "seed": 1})
    return acme, globex, model


def test_a_cache_past_its_ttl_loses_its_tokens_and_a_live_one_keeps_them(db, setup):
    from controlplane.audit.models import AuditEvent
    from controlplane.caches.services import caches_sweep

    acme, globex, model = setup
    live = _make(acme, model, ttl_s=3600)
    expired = _make(acme, model, ttl_s=-1, token_ids=range(40))
    chat = _make(globex, model, ttl_s=-60, token_ids=range(20), messages=[{"role": "system", "content": "secret"}])
    deleted = _make(acme, model, ttl_s=3600, token_ids=range(8), deleted=True)  # a delete that kept them

    result = caches_sweep()
    assert (result.caches, result.expired, result.deleted, result.tokens, result.tenants) == (3, 2, 1, 68, 2)
    for row in (expired, chat, deleted):
        row.refresh_from_db()
        assert row.token_ids == [] and row.messages is None
    assert (expired.tokens, chat.tokens, expired.pinned_tokens) == (40, 20, 16)  # the counts stay
    live.refresh_from_db()
    assert live.token_ids == [1, 2, 3, 4]  # paired: a live cache keeps its prompt

    event = AuditEvent.objects.get(action="cache.sweep")
    assert event.new_value == {"caches": 3, "expired": 2, "deleted": 1, "tokens": 68, "tenants": 2}
    assert event.actor == "system:caches.sweep" and "secret" not in str(event.new_value)
    assert caches_sweep().caches == 0  # idempotent: nothing left to clear, and no event for nothing
    assert AuditEvent.objects.filter(action="cache.sweep").count() == 1


def test_a_ttl_change_cannot_revive_a_cache_that_expired_after_it_was_read(db, setup, actor):
    """A PATCH that read the cache live, then lost the race to its expiry and the sweep: 404, and the
    row stays expired (else a live cache with no tokens would be served by ``cache_id``)."""
    from controlplane.caches import selectors
    from controlplane.caches.models import NamedCache
    from controlplane.caches.services import cache_set_ttl, caches_sweep

    acme, _, model = setup
    cache = _make(acme, model, ttl_s=3600)
    read = selectors.cache_get(acme, cache.public_id)
    assert read is not None
    NamedCache.objects.filter(pk=cache.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert caches_sweep().caches == 1
    with pytest.raises(NotFound):
        cache_set_ttl(read, ttl_seconds=600, actor=actor)
    cache.refresh_from_db()
    assert cache.expires_at < timezone.now() and cache.token_ids == []
    assert selectors.cache_get(acme, cache.public_id) is None
    live = _make(acme, model, ttl_s=3600)  # paired: a live cache's TTL does move
    assert cache_set_ttl(live, ttl_seconds=600, actor=actor).expires_at < timezone.now() + timedelta(seconds=700)


def test_the_sweep_thread_runs_on_the_l3_retention_sweeps_period(transactional_db, setup, monkeypatch):
    import time

    from controlplane.caches import sweeper

    monkeypatch.setenv("STRATA_L3_SWEEP_SECONDS", "7")
    assert sweeper.period_seconds() == 7
    acme, _, model = setup
    expired = _make(acme, model, ttl_s=-1)
    monkeypatch.setattr(sweeper, "_thread", None)
    thread = sweeper.start()
    try:
        assert thread.interval == 7 and thread.name == "strata-cache-sweep"
        assert sweeper.start() is thread  # one per process
        deadline = time.monotonic() + 30
        while thread.taken == 0:  # the first sweep runs at start
            assert time.monotonic() < deadline, "the sweep thread did not sweep"
            time.sleep(0.05)
    finally:
        thread.stop()
        thread.join(timeout=10)
    expired.refresh_from_db()
    assert expired.token_ids == []
