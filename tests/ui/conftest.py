"""Operator UI fixtures: staff users (a superuser = admin, plain staff = viewer), logged-in test
clients, sample data created through the services, (re-exported) the real Ray / uvicorn / Celery
fixtures that the live tests use, and the browser prerequisite: :func:`require_chromium`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from django.test import Client

from tests.jobs.conftest import celery_worker_factory  # noqa: F401  (re-exported fixtures)
from tests.serving.conftest import asgi_url, platform, ray_cluster  # noqa: F401

PASSWORD = "correct horse battery staple"

# The browser test drives the machine's Chromium (Debian's `chromium` package). `make test` installs
# it when it can (.ci/ensure-chromium, which looks in the same places).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_MISSING = ("missing prerequisite: Chromium for the operator UI browser test "
                    "(install it with `apt-get install -y chromium`; `make test` does so when run as root)")


def find_chromium() -> str | None:
    """The Chromium executable: /usr/bin/chromium, else ``chromium``/``chromium-browser`` on PATH."""
    if Path(CHROMIUM).exists():
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def chromium_decision(path: str | None, ci: bool) -> tuple[str, str]:
    """``("run", path)`` when Chromium is there; otherwise ``("skip", why)`` on a developer's machine
    and ``("fail", why)`` under CI, where the browser test is required and must not silently vanish."""
    if path:
        return "run", path
    if ci:
        return "fail", f"{CHROMIUM_MISSING}; CI=true requires it"
    return "skip", CHROMIUM_MISSING


def require_chromium() -> str:
    """Chromium's path, or skip (outside CI) / fail (``CI=true``) the calling test with one clear line."""
    verdict, detail = chromium_decision(find_chromium(), in_ci())
    if verdict == "fail":
        pytest.fail(detail, pytrace=False)
    if verdict == "skip":
        pytest.skip(detail)
    return detail


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
