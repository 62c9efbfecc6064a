"""vLLM's own engine figures per replica (KV cache usage, waiting and running requests,
preemptions): recorded from vLLM's stat loggers by the replica, served in ``/metrics`` and on the
console's dashboard."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.test_grafana_dashboard import VLLM_SERIES, dashboard_series
from workers.vllm_engine_figures import EngineFigures

pytest.importorskip("vllm")


def test_the_holder_keeps_the_last_report_and_counts_preemptions():
    figures = EngineFigures()
    assert figures.snapshot() == {"kv_cache_usage": 0.0, "waiting": 0, "running": 0, "preemptions": 0,
                                  "reported": False}
    figures.record(engine=0, kv_cache_usage=0.25, waiting=3, running=2, preempted=1)
    figures.record(engine=0, kv_cache_usage=0.5, waiting=1, running=4, preempted=2)
    figures.record(engine=0, kv_cache_usage=None, waiting=None, running=None, preempted=1)  # iteration only
    assert figures.snapshot() == {"kv_cache_usage": 0.5, "waiting": 1, "running": 4, "preemptions": 4,
                                  "reported": True}


def _series(text: str, name: str, model: str) -> list[float]:
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and s.labels.get("model") == model and s.labels.get("replica") == "0"]


@pytest.mark.slow
def test_a_vllm_replica_reports_its_engine_figures_in_metrics_and_on_the_dashboard(
        platform, admin_client, actor, vllm_checkpoint, django_user_model):
    from django.test import Client

    from controlplane.registry.services import model_create
    from controlplane.runtime.stats import cluster_stats
    from controlplane.tenants.access import grant_create

    deployment = model_create(actor=actor, name="tiny-figures-vllm", preset="", engine="vllm",
                              revision={"label": "r1", "path": str(vllm_checkpoint[0])})
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=deployment)
    out = platform.client("acme").completions.create(model=deployment.name, prompt="The engine reports " * 8,
                                                     max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1
    worker = next(w for w in cluster_stats(refresh=True)["workers"] if w["model"] == deployment.name)
    figures = worker["engine_figures"]
    assert figures["reported"] and 0.0 <= figures["kv_cache_usage"] <= 1.0 and figures["preemptions"] >= 0

    text = admin_client.get("/metrics").content.decode()
    for name in ("strata_vllm_kv_cache_usage_ratio", "strata_vllm_requests_waiting",
                 "strata_vllm_requests_running", "strata_vllm_preemptions_total"):
        assert len(_series(text, name, deployment.name)) == 1, name
    assert not _series(text, "strata_vllm_requests_waiting", platform.model)  # Strata's engine: none
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    grafana = {name for name in dashboard_series() if name.startswith(VLLM_SERIES)}
    assert len(grafana) == 4 and grafana <= served, sorted(grafana - served)  # the Grafana panels' series

    boss = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw")
    ui = Client()
    ui.force_login(boss)
    page = ui.get("/ui/").content.decode()
    assert "vLLM engines" in page and f'id="vllm-{deployment.name}-0"' in page
    assert httpx.get(f"{platform.url}/healthz").status_code == 200
