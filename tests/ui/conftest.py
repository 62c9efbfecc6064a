"""Operator UI fixtures: staff users (a superuser = admin, plain staff = viewer), logged-in test
clients, sample data created through the services, and (re-exported) the real Ray / uvicorn /
Celery fixtures that the live tests use."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.jobs.conftest import celery_worker_factory  # noqa: F401  (re-exported fixtures)
from tests.serving.conftest import asgi_url, platform, ray_cluster  # noqa: F401

PASSWORD = "correct horse battery staple"


@pytest.fixture
def admin_user(django_user_model):
    return django_user_model.objects.create_superuser("alice", "alice@example.com", PASSWORD)


@pytest.fixture
def viewer_user(django_user_model):
    return django_user_model.objects.create_user("victor", "victor@example.com", PASSWORD, is_staff=True)


@pytest.fixture
def admin_ui(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


@pytest.fixture
def viewer_ui(viewer_user) -> Client:
    client = Client()
    client.force_login(viewer_user)
    return client


@pytest.fixture
def tenant(db, actor):
    from controlplane.tenants.services import tenant_create

    return tenant_create(actor=actor, slug="acme", name="Acme Corp", quotas={"requests_per_minute": 600})


@pytest.fixture
def model(db, actor):
    from controlplane.registry.services import model_create, revision_create

    deployment = model_create(actor=actor, name="tiny-llama", preset="tiny", revision={"label": "r1", "seed": 7})
    revision_create(actor=actor, deployment=deployment, label="r2", seed=8)
    return deployment
