"""The shipped Grafana dashboard and Prometheus scrape example stay true: every metric the dashboard
queries is one ``/metrics`` really serves (on a running platform, after some traffic)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
VLLM_SERIES = "strata_vllm_"


def dashboard_series() -> set[str]:
    """Every ``strata_*`` series the shipped Grafana dashboard queries."""
    dashboard = json.loads((DEPLOY / "grafana" / "strata-dashboard.json").read_text())
    return {name for p in dashboard["panels"] for t in p["targets"]
            for name in re.findall(r"strata_[a-z0-9_]+", t["expr"])}


def test_every_dashboard_metric_is_served(platform, admin_client):
    url, h = f"{platform.url}/v1/completions", {"Authorization": f"Bearer {platform.keys['acme']}"}
    for stream in (False, True):
        r = httpx.post(url, headers=h, timeout=60,
                       json={"model": platform.model, "prompt": "Grafana " * 8, "max_tokens": 2, "stream": stream})
        assert r.status_code == 200
    text = admin_client.get("/metrics").content.decode()
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((DEPLOY / "grafana" / "strata-dashboard.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p["targets"]
               for name in re.findall(r"strata_[a-z0-9_]+", t["expr"])}
    # vLLM replicas' series: tests/vllm/test_vllm_engine_figures.py checks them on a vLLM replica
    vllm = {name for name in queried if name.startswith(VLLM_SERIES)}
    assert queried and queried - vllm <= served, sorted(queried - vllm - served)
    assert {"strata_tenant_ttft_seconds_bucket", "strata_tenant_queue_seconds_bucket", "strata_jobs",
            "strata_audit_head_seq"} <= queried - vllm
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_scrape_example_points_at_metrics_with_a_bearer_token():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
