"""The access generation (``serving.access_generation``) moves with every change admission reads, and
only with those: each write below is paired with the check that the number moved (or, for marking a
key used, that it did not)."""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db


def moved(fn) -> bool:
    from controlplane.serving.access_generation import current

    before = current(connection)
    fn()
    return current(connection) != before


@pytest.fixture
def setup(actor):
    from controlplane.registry.services import model_create
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    deployment = model_create(actor=actor, name="gen-model", preset="tiny", revision={"label": "r1", "seed": 1})
    tenant = tenant_create(actor=actor, slug="gen", name="Gen")
    grant_create(actor=actor, tenant=tenant, deployment=deployment)
    key, _ = api_key_create(actor=actor, tenant=tenant)
    return tenant, key, deployment


def test_every_change_admission_reads_moves_the_generation(setup, actor):
    from django.utils import timezone

    from controlplane.tenants.access import grant_delete, share_group_add, share_group_create
    from controlplane.tenants.models import ApiKey, Tenant
    from controlplane.tenants.services import api_key_create, api_key_revoke, tenant_update

    tenant, key, deployment = setup
    assert moved(lambda: tenant_update(actor=actor, tenant=tenant, quotas={"tokens_per_minute": 10}))
    assert moved(lambda: Tenant.objects.filter(pk=tenant.pk).update(status="suspended"))
    assert moved(lambda: share_group_add(actor=actor, group=share_group_create(actor=actor, slug="g", name="G"),
                                         tenant=tenant))
    assert moved(lambda: grant_delete(actor=actor, tenant=tenant, deployment=deployment))
    assert moved(lambda: type(deployment).objects.filter(pk=deployment.pk).update(replicas=2))
    assert moved(lambda: type(deployment.active_revision).objects.filter(deployment=deployment)
                 .update(digest="0" * 64))
    assert moved(lambda: ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now()))
    other, _ = api_key_create(actor=actor, tenant=Tenant.objects.get(pk=tenant.pk))
    assert moved(lambda: api_key_revoke(actor=actor, api_key=other))
    assert moved(lambda: ApiKey.objects.filter(pk=other.pk).delete())


def test_marking_a_key_used_does_not_move_it(setup):
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.services import api_key_mark_used

    _, key, _ = setup
    assert not moved(lambda: api_key_mark_used(api_key=key))
    assert ApiKey.objects.get(pk=key.pk).last_used is not None  # it did write
    assert moved(lambda: ApiKey.objects.filter(pk=key.pk).update(prefix="other"))  # paired: other columns do


def test_a_missing_row_comes_back_with_a_fresh_random_value():
    from controlplane.serving.access_generation import TABLE, current

    first = current(connection)
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {TABLE}")  # noqa: S608 (a constant)
    second = current(connection)
    assert second is not None and second != first
    assert current(connection) == second  # and then it stays until something changes


def test_the_triggers_come_back_after_migrate(setup):
    """SQLite drops a table's triggers when a migration rebuilds it: ``post_migrate`` reinstalls them."""
    from django.db.models.signals import post_migrate

    from controlplane.serving import access_generation
    from controlplane.serving.apps import ServingConfig
    from controlplane.tenants.models import Tenant

    tenant, _, _ = setup
    access_generation.uninstall(connection)
    assert not moved(lambda: Tenant.objects.filter(pk=tenant.pk).update(name="x"))
    from django.apps import apps

    post_migrate.send(sender=apps.get_app_config("serving"), app_config=apps.get_app_config("serving"),
                      using="default", verbosity=0, interactive=False, plan=[], apps=apps)
    assert isinstance(apps.get_app_config("serving"), ServingConfig)
    assert moved(lambda: Tenant.objects.filter(pk=tenant.pk).update(name="y"))
