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


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
SHOTS = Path(os.environ.get("STRATA_SCREENSHOTS") or "/tmp/strata-screenshots")


@pytest.fixture(scope="session")
def chromium() -> str | None:
    """First argument of each test: without Chromium it skips here; under CI it returns None and the
    test's first line (:func:`require_chromium`) FAILS it instead."""
    verdict, detail = chromium_decision(find_chromium(), in_ci())
    if verdict == "skip":
        pytest.skip(detail)
    return detail if verdict == "run" else None


@pytest.fixture
def logged_in_page(chromium, live_server, admin_user):
    """``logged_in_page(width)`` -> a Chromium page ``width`` px wide with alice's session cookie. Call it
    after the test's ORM work (Playwright's sync API runs an event loop in this thread, under which
    Django refuses ORM calls); the session is made here, before that."""
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(admin_user)
    cookie = {"name": settings.SESSION_COOKIE_NAME, "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
              "url": live_server.url}
    started = []

    def launch(width: int):
        from playwright.sync_api import sync_playwright

        if not started:
            started.append(sync_playwright().start())
        browser = started[0].chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": width, "height": 900})
        context.add_cookies([cookie])
        page = context.new_page()
        page.set_default_timeout(30_000)
        return page

    yield launch
    for pw in started:
        pw.stop()


def shot(page, name: str, full_page: bool = True) -> None:
    """A screenshot of the page as an artifact of the run (``$STRATA_SCREENSHOTS``, never committed)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full_page)


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
