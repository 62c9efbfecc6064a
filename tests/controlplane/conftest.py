"""Control-plane fixtures: a tenant and a seeded model created through the services."""

import pytest


@pytest.fixture
def tenant(db, actor):
    from controlplane.tenants.services import tenant_create

    return tenant_create(actor=actor, slug="acme", name="Acme Corp")


@pytest.fixture
def model(db, actor):
    from controlplane.registry.services import model_create

    return model_create(actor=actor, name="tiny-llama", preset="tiny", revision={"label": "r1", "seed": 7})

