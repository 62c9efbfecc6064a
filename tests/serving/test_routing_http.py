"""Cache-aware routing over HTTP with two real replicas (the suite's local Ray): the router's prefix
index, fed by the replicas' KV events, sends every request extending a cached prefix to the replica
that holds it, so each is a hit (round robin would send half of them to the replica that does not);
the index is scoped like the cache: another tenant's hashes of the same tokens match nothing."""

from __future__ import annotations

import time

import httpx
import pytest

from workers.cache_worker import CacheWorker

MODEL = "tiny-routed"
PREFIX = list(range(40, 40 + 160))  # ten full blocks
pytestmark = pytest.mark.skipif(not hasattr(CacheWorker, "kv_events"),
                                reason="needs the cache worker's KV events (issue 11)")


@pytest.fixture
def routed(platform, actor, monkeypatch):
    """A two-replica deployment granted to acme and globex, both replicas started; killed after."""
    import ray

    from controlplane.registry.services import model_create, model_set_replicas
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create

    monkeypatch.setattr(gateway, "apply_scale", lambda spec, **kw: None)  # started below, in this thread
    deployment = model_create(actor=actor, name=MODEL, preset="tiny", revision={"label": "r1", "seed": 9})
    deployment = model_set_replicas(actor=actor, deployment=deployment, replicas=2)
    for slug in ("acme", "globex"):
        grant_create(actor=actor, tenant=platform.tenants[slug], deployment=deployment)
    spec = gateway.spec_for(deployment)
    handles = gateway.replica_set(spec).start_all()
    yield spec
    gateway.forget(MODEL)
    for handle in handles:
        ray.kill(handle, no_restart=True)


def _complete(platform, tenant: str, tokens: list[int]) -> dict:
    resp = httpx.post(f"{platform.url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {platform.keys[tenant]}"},
                      json={"model": MODEL, "prompt": tokens, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text[:300]
    return resp.json()["usage"]


def _hashes(router, platform, tenant: str, tokens: list[int]) -> list[bytes]:
    from cachecore.routing.hashes import request_hashes
    from controlplane.tenants.selectors import tenant_scope_salt

    view = next(v for v in router._views.values() if v.namespace_fields)
    return request_hashes(view.namespace_fields, tenant_scope_salt(platform.tenants[tenant]), tokens)


def test_requests_extending_a_cached_prefix_go_to_the_replica_holding_it(platform, routed):
    from controlplane.runtime import gateway

    router = gateway.router(routed)
    assert router.index is not None and router.mode == "strata"
    assert _complete(platform, "acme", PREFIX + [7])["prompt_tokens_details"]["cached_tokens"] == 0
    hashes = _hashes(router, platform, "acme", PREFIX)
    deadline = time.monotonic() + 30
    while not router.index.match(hashes, 16):  # the stored blocks' events reached the index
        assert time.monotonic() < deadline, "the router's index never learned the stored prefix"
        time.sleep(0.1)
    (holder,) = router.index.match(hashes, 16)
    decided = router.decisions["policy"]
    for i in range(6):
        usage = _complete(platform, "acme", PREFIX + [100 + i, 7])
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 144, (i, usage)  # >= 9 of 10 blocks
    assert router.decisions["policy"] - decided == 6
    assert set(router.index.match(hashes, 16)) == {holder}  # still the only replica holding it

    # Scoped like the cache: globex's hashes of the same tokens match no replica, and its request misses.
    assert router.index.match(_hashes(router, platform, "globex", PREFIX), 16) == {}
    assert _complete(platform, "globex", PREFIX + [7])["prompt_tokens_details"]["cached_tokens"] == 0
