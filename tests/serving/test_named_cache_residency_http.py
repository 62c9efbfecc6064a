"""A named cache's ``tiers`` say where its tokens are now (issue 47, item 1), over HTTP against the real
server and a real local Ray replica: asked from the replicas on every read (``GET /v1/caches/{id}``,
``GET /v1/caches``, the admin listing and the console), the last known figures marked
``tiers_stale`` with ``tiers_as_of`` while no replica can answer, and after the replica is started
anew, L1 and L2 empty and L3 still holding the prefix (what a request would hit)."""

from __future__ import annotations

import time

import httpx
import pytest
from django.test import Client

DOC = "Strata residency document: where do the prefix's tokens live after a restart? " * 5


def _h(platform, tenant="acme"):
    return {"Authorization": f"Bearer {platform.keys[tenant]}"}


def _get(platform, cache_id):
    r = httpx.get(f"{platform.url}/v1/caches/{cache_id}", headers=_h(platform), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def operator(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("olga", "olga@example.com", "pw-x-123456"))
    return client


def test_tiers_follow_the_replica_stale_while_it_is_gone_and_l3_only_after_its_restart(platform, operator):
    import ray

    from controlplane.tenants.models import Tenant
    from workers import actor as worker_actor

    Tenant.objects.filter(slug="acme").update(max_pinned_tokens=100_000)
    r = httpx.post(f"{platform.url}/v1/caches", headers=_h(platform), timeout=300,
                   json={"model": platform.model, "prompt": DOC, "display_name": "where"})
    assert r.status_code == 201, r.text
    created = r.json()
    full = created["pinned_tokens"]
    assert full > 0 and created["tiers_stale"] is False

    # asked now: every tier holds the prefix's full blocks
    now = _get(platform, created["id"])
    assert now["tiers_stale"] is False and now["tiers_as_of"] >= created["created_at"]
    assert now["tiers"]["l2"] == full and 0 < now["tiers"]["l3"] <= full  # L3 keeps whole chunks
    in_l3 = now["tiers"]["l3"]

    # the replica is gone: the last known figures, marked stale and as of when they were true; the
    # read does not wait for the dead replica
    ray.kill(worker_actor.find(platform.model, 0), no_restart=True)
    t0 = time.monotonic()
    gone = _get(platform, created["id"])
    assert time.monotonic() - t0 < 20  # generous: no replica held it (the bound is ASK_TIMEOUT_S)
    assert gone["tiers_stale"] is True and gone["tiers"] == now["tiers"]
    assert gone["tiers_as_of"] <= int(time.time())
    listed = operator.get("/api/admin/tenants/acme/caches")
    assert listed.status_code == 200
    assert listed.json()[0]["tiers_stale"] is True and listed.json()[0]["tiers"] == now["tiers"]
    page = operator.get("/ui/tenants/acme/").content.decode()
    assert 'data-stale="true"' in page and "last known" in page

    # a request brings the replica back (revived in the background; 503 meanwhile) with empty L1/L2
    deadline = time.monotonic() + 180
    while True:
        resp = httpx.post(f"{platform.url}/v1/completions", headers=_h(platform, "globex"), timeout=120,
                          json={"model": platform.model, "prompt": "something else", "max_tokens": 1})
        if resp.status_code == 200:
            break
        assert resp.status_code == 503, resp.text
        assert time.monotonic() < deadline, "the replica was not revived within 180 s"
        time.sleep(1)

    after = _get(platform, created["id"])
    assert after["tiers_stale"] is False
    assert after["tiers"] == {"l1": 0, "l2": 0, "l3": in_l3}
    listed = operator.get("/api/admin/tenants/acme/caches").json()
    assert listed[0]["tiers"] == {"l1": 0, "l2": 0, "l3": in_l3} and listed[0]["tiers_stale"] is False
    page = operator.get("/ui/tenants/acme/").content.decode()
    assert 'data-stale="true"' not in page
    assert "L1 0 · L2 0 · L3" in page
    # the last known figures are the new ones (what a read shows when the replica cannot answer next)
    from controlplane.caches.models import NamedCache

    assert NamedCache.objects.get(public_id=created["id"]).tiers == {"l1": 0, "l2": 0, "l3": in_l3}

    # and it is true: a request of the prefix hits what L3 holds, no more
    hit = platform.client("acme").completions.create(model=platform.model, prompt=DOC + " Q?", max_tokens=1,
                                                     temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens == in_l3
