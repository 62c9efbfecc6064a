"""Control-plane fixtures: a tenant and a seeded model created through the services, fresh throttle
counters for every test, and a clock to move for the throttling tests."""

import time
import uuid

import pytest


@pytest.fixture(autouse=True)
def fresh_throttles(settings):
    """Each test starts with no failed logins or bad tokens counted (clients all come from
    127.0.0.1): a namespace of its own rather than a cache clear, which on Redis would empty it."""
    settings.STRATA_THROTTLE_NAMESPACE = f"test-{uuid.uuid4().hex}"


@pytest.fixture
def tenant(db, actor):
    from controlplane.tenants.services import tenant_create

    return tenant_create(actor=actor, slug="acme", name="Acme Corp")


@pytest.fixture
def model(db, actor):
    from controlplane.registry.services import model_create

    return model_create(actor=actor, name="tiny-llama", preset="tiny", revision={"label": "r1", "seed": 7})



class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(settings, monkeypatch):
    """Freeze ``time.time`` (cache expiry, throttle windows) over a private local-memory cache, so a
    test passes a window without waiting and never touches a shared Redis."""
    run = uuid.uuid4().hex
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"throttle-tests-{run}"},
                       **{alias: {"BACKEND": "controlplane.common.limit_store.ExpiringOnlyCache",
                                  "LOCATION": f"throttle-tests-{alias}-{run}", "TIMEOUT": None}
                          for alias in ("limits", "lockouts")}}
    fake = Clock()
    monkeypatch.setattr(time, "time", fake)
    return fake
