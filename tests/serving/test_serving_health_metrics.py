"""Serving health in ``/metrics``: every ``/v1/`` answer by route, status and error code (refusals the
gate answers before any view included), per tenant and model, end-to-end latency and TTFT."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _samples(admin_client):
    text = admin_client.get("/metrics").content.decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples, name, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_refusals_successes_and_latency_are_counted(platform, admin_client):
    from controlplane.tenants.models import Tenant

    before = _samples(admin_client)
    Tenant.objects.filter(slug="initech").update(requests_per_minute=2, max_prompt_tokens=64)
    url, h = f"{platform.url}/v1/completions", {"Authorization": f"Bearer {platform.keys['initech']}"}
    ok = httpx.post(url, headers=h, json={"model": platform.model, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    big = httpx.post(url, headers=h, json={"model": platform.model, "prompt": "x" * 500, "max_tokens": 1}, timeout=60)
    assert big.status_code == 413
    limited = httpx.post(url, headers=h, json={"model": platform.model, "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert limited.status_code == 429
    anonymous = httpx.post(url, json={"model": platform.model, "prompt": "hi"}, timeout=60)
    assert anonymous.status_code == 401
    with httpx.stream("POST", url, json={"model": platform.model, "prompt": "hello", "max_tokens": 3, "stream": True},
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"}, timeout=60) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    after = _samples(admin_client)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    route = "/v1/completions"
    assert delta("strata_http_requests_total", route=route, status="200") == 2
    assert delta("strata_http_requests_total", route=route, status="413", code=big.json()["error"]["code"]) == 1
    assert delta("strata_http_requests_total", route=route, status="429", code="rate_limit_requests") == 1
    assert delta("strata_http_requests_total", route=route, status="401", code="missing_api_key") == 1
    assert delta("strata_tenant_requests_total", tenant="initech", model=platform.model, outcome="ok") == 1
    assert delta("strata_tenant_requests_total", tenant="initech", outcome="rate_limit_requests") == 1
    assert delta("strata_tenant_requests_total", tenant="initech", outcome=big.json()["error"]["code"]) == 1
    assert delta("strata_request_seconds_count", route=route, model=platform.model) >= 2
    assert delta("strata_ttft_seconds_count", route=route, model=platform.model) == 1
    assert not [s for s in after if s.name.startswith("strata_tenant_requests") and s.labels["tenant"] == ""]


def test_the_dashboard_and_the_tenant_page_show_serving_health(platform, admin_client):
    from controlplane.tenants.models import Tenant

    Tenant.objects.filter(slug="globex").update(requests_per_minute=1)
    url, h = f"{platform.url}/v1/completions", {"Authorization": f"Bearer {platform.keys['globex']}"}
    for _ in range(2):
        httpx.post(url, headers=h, json={"model": platform.model, "prompt": "hi", "max_tokens": 1}, timeout=60)
    from django.contrib.auth import get_user_model
    from django.test import Client

    staff = get_user_model().objects.create_user("ops", password="x-pw-12345!", is_staff=True, is_superuser=True)
    ui = Client()
    ui.force_login(staff)
    dash = ui.get("/ui/").content.decode()
    assert "Serving health" in dash and "rate_limit_requests" in dash and "TTFT p99" in dash
    page = ui.get("/ui/tenants/globex/").content.decode()
    assert "Serving answers to this tenant" in page and "rate_limit_requests" in page
