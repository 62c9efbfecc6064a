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
    assert queried and queried <= served, sorted(queried - served)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_scrape_example_points_at_metrics_with_a_bearer_token():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
