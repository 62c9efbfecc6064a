"""Request ids and the access log over real HTTP (uvicorn serving ``controlplane.asgi``): every
response carries ``X-Request-Id`` (generated, or a trusted proxy's, bounded), and each request is one
JSON line on ``strata.access`` with its tenant, model, status and duration; per-tenant TTFT and
queue time reach ``/metrics``."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

GENERATED = re.compile(r"[0-9a-f]{32}")


def _access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "strata.access"]


def _line(caplog, rid: str) -> dict:
    """The request's access line: written once the response is over, which the client may see first."""
    deadline = time.monotonic() + 10
    while not (found := [line for line in _access_lines(caplog) if line["request_id"] == rid]):
        assert time.monotonic() < deadline, f"no access line for {rid}"
        time.sleep(0.02)
    assert len(found) == 1, found  # one line per request
    return found[0]


@pytest.fixture
def access_log(caplog):
    caplog.set_level(logging.INFO, logger="strata.access")
    return caplog


def test_every_response_carries_a_fresh_generated_request_id(platform, admin_client, access_log):
    ids = []
    for response in (httpx.get(f"{platform.url}/healthz"),
                     httpx.post(f"{platform.url}/v1/completions", json={"model": platform.model, "prompt": "hi"}),
                     httpx.get(f"{platform.url}/api/admin/tenants"),
                     httpx.get(f"{platform.url}/no/such/page")):
        rid = response.headers["X-Request-Id"]
        assert GENERATED.fullmatch(rid), rid
        assert response.headers.get_list("X-Request-Id") == [rid]
        ids.append((rid, response.status_code))
    assert len({rid for rid, _ in ids}) == 4
    for rid, status in ids:
        assert _line(access_log, rid)["status"] == status


def test_a_completion_is_one_json_access_line_with_tenant_model_status_and_duration(platform, access_log):
    response = httpx.post(f"{platform.url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                          json={"model": platform.model, "prompt": "hello there", "max_tokens": 2})
    assert response.status_code == 200
    line = _line(access_log, response.headers["X-Request-Id"])
    assert (line["tenant"], line["model"], line["status"]) == ("acme", platform.model, 200)
    assert (line["method"], line["path"], line["source"]) == ("POST", "/v1/completions", "127.0.0.1")
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0
    record = next(r for r in access_log.records if r.name == "strata.access" and line["request_id"] in r.getMessage())
    assert record.levelno == logging.INFO and "\n" not in record.getMessage()
    refused = httpx.post(f"{platform.url}/v1/completions", json={"model": platform.model, "prompt": "x"},
                         headers={"Authorization": "Bearer sk-st-wrong"}, timeout=60)
    line = _line(access_log, refused.headers["X-Request-Id"])
    assert (line["tenant"], line["model"], line["status"]) == ("", "", 401)


@pytest.mark.parametrize("presented", ["abc-123", "trace:7f.ok_1", "x" * 128])
def test_a_spoofed_request_id_from_an_untrusted_peer_is_replaced(platform, access_log, settings, presented):
    settings.STRATA_TRUSTED_PROXIES = []
    response = httpx.get(f"{platform.url}/healthz", headers={"X-Request-Id": presented})
    rid = response.headers["X-Request-Id"]
    assert rid != presented and GENERATED.fullmatch(rid)
    assert _line(access_log, rid)["path"] == "/healthz"
    # The same id from a trusted proxy is kept, end to end.
    settings.STRATA_TRUSTED_PROXIES = ["127.0.0.1/32"]
    kept = httpx.get(f"{platform.url}/healthz", headers={"X-Request-Id": presented})
    assert kept.headers["X-Request-Id"] == presented
    assert _line(access_log, presented)["status"] == 200


@pytest.mark.parametrize("presented", ["x" * 129, "has space", "semi;colon", "quote\"", "é"])
def test_a_trusted_proxys_request_id_is_kept_only_when_short_and_plain(platform, access_log, settings, presented):
    settings.STRATA_TRUSTED_PROXIES = ["127.0.0.1/32"]
    response = httpx.get(f"{platform.url}/healthz", headers={"X-Request-Id": presented.encode()})
    rid = response.headers["X-Request-Id"]
    assert GENERATED.fullmatch(rid) and _line(access_log, rid)["status"] == 200


def _samples(admin_client):
    text = admin_client.get("/metrics").content.decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _count(samples, name, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_per_tenant_ttft_and_queue_time_are_in_metrics_after_a_streamed_request(platform, admin_client):
    before = _samples(admin_client)
    with httpx.stream("POST", f"{platform.url}/v1/completions", timeout=60,
                      json={"model": platform.model, "prompt": "hello", "max_tokens": 3, "stream": True},
                      headers={"Authorization": f"Bearer {platform.keys['globex']}"}) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    after = _samples(admin_client)
    labels = {"tenant": "globex", "model": platform.model}
    for name in ("strata_tenant_ttft_seconds_count", "strata_tenant_queue_seconds_count"):
        assert _count(after, name, **labels) - _count(before, name, **labels) == 1, name
    # Only the tenant that sent it: the other tenants have no new observation.
    for name in ("strata_tenant_ttft_seconds_count", "strata_tenant_queue_seconds_count"):
        assert _count(after, name, tenant="acme") == _count(before, name, tenant="acme")
    assert not [s for s in after if s.name.startswith("strata_tenant_ttft") and s.labels.get("tenant") == ""]
