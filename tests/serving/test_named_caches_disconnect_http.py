"""A prewarm whose client hangs up (issue 42, item 7), over HTTP against the real server and a real
worker: it is cancelled on its worker like a completion, and what it wrote before it stopped is booked
in the tenant's ledger (no cache row: nobody holds its id)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

MODEL = "small-prewarm"
REVISION = {"label": "r1", "seed": 5}
# 250 full blocks and one token: a prefill of seconds on a CPU (the small model: about one second per
# 2,048 tokens), so the client below leaves while it runs; a later completion of the same prompt can
# hit every full block the prewarm wrote
PROMPT_TOKENS = 250 * 16 + 1


@pytest.fixture
def slow(platform, actor):
    """A deployment of the ``small`` model, granted to acme: its prefill takes seconds."""
    import ray

    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway
    from controlplane.tenants.access import grant_create
    from workers import actor as worker_actor

    deployment = model_create(actor=actor, name=MODEL, preset="small", revision=dict(REVISION))
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=deployment)
    handle = worker_actor.launch(MODEL, "small", dict(REVISION), l1_mb=128, l2_mb=0)
    ray.get(handle.ping.remote())
    yield gateway.spec_for(deployment)
    gateway.forget(MODEL)
    ray.kill(handle)


def _until(what: str, check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.1)


def test_a_prewarm_whose_client_hangs_up_is_cancelled_and_what_it_wrote_is_booked(platform, slow):
    from django.utils import timezone

    from controlplane.caches.models import NamedCache
    from controlplane.ledger.selectors import ledger_totals
    from controlplane.runtime import gateway

    tenant = platform.tenants["acme"]
    since = timezone.now().replace(minute=0, second=0, microsecond=0)
    before = gateway.call(slow, "info")["cancelled"]
    prompt = torch.randint(0, 256, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()
    with pytest.raises(httpx.ReadTimeout):  # the client leaves after a second, mid-prefill
        httpx.post(f"{platform.url}/v1/caches", json={"model": MODEL, "prompt": prompt}, timeout=1.0,
                   headers={"Authorization": f"Bearer {platform.keys['acme']}"})

    info = _until("the prewarm's cancel", lambda: (i := gateway.call(slow, "info"))["cancelled"] > before
                  and i["running"] == 0 and i)
    assert info["cancelled"] == before + 1
    assert gateway.call(slow, "check_integrity") is True
    booked = _until("the prewarm's booking",
                    lambda: (t := ledger_totals(tenant=tenant, model=MODEL, since=since)).counts["requests"] and t)
    assert booked.counts["requests"] == 1 and booked.counts["prompt_tokens"] == PROMPT_TOKENS
    written = booked.counts["write_tokens"]
    assert 0 <= written < PROMPT_TOKENS - 1  # stopped before the end of its prefill
    assert NamedCache.objects.filter(tenant=tenant).count() == 0

    # what it wrote is what the cache holds: a completion of the same prompt hits exactly that
    after = platform.client("acme").completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == written
