"""vLLM's engine figures per replica, from the replicas' last stats samples (``stats.cluster_stats``'
``workers``; ``workers.vllm_engine_figures`` on the replica): for ``/metrics`` and the console.

Series (labels ``model``, ``replica``; only replicas on the vLLM engine that answered and whose engine
has reported once): ``strata_vllm_kv_cache_usage_ratio`` (0..1 of vLLM's device KV cache in use),
``strata_vllm_requests_waiting`` and ``strata_vllm_requests_running`` (vLLM's scheduler queues), and
``strata_vllm_preemptions_total`` (requests vLLM preempted since the revision's engine started: a
rollout or restart resets it, as a Prometheus counter may).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = {  # snapshot key -> (metric name, help)
    "kv_cache_usage": ("strata_vllm_kv_cache_usage_ratio", "Share of vLLM's device KV cache in use (0..1)"),
    "waiting": ("strata_vllm_requests_waiting", "Requests waiting in vLLM's scheduler"),
    "running": ("strata_vllm_requests_running", "Requests running in vLLM's scheduler"),
}


def engine_rows(workers: list[dict]) -> list[dict]:
    """One row per reporting vLLM replica: ``model``, ``replica`` and the engine figures."""
    rows = []
    for w in workers:
        figures = w.get("engine_figures") if w.get("status") == "ok" else None
        if figures and figures.get("reported"):
            rows.append({"model": w["model"], "replica": int(w.get("replica", 0)), **figures})
    return sorted(rows, key=lambda r: (r["model"], r["replica"]))


class EngineCollector:
    """``prometheus_client`` collector of :func:`engine_rows`."""

    def __init__(self, workers: list[dict]) -> None:
        self.rows = engine_rows(workers)

    def collect(self):
        labels = ["model", "replica"]
        gauges = {key: GaugeMetricFamily(name, help_, labels=labels) for key, (name, help_) in GAUGES.items()}
        preemptions = CounterMetricFamily("strata_vllm_preemptions", "Requests vLLM preempted since the "
                                          "revision's engine started", labels=labels)
        for row in self.rows:
            key = [row["model"], str(row["replica"])]
            for name, family in gauges.items():
                family.add_metric(key, row[name])
            preemptions.add_metric(key, row["preemptions"])
        yield from (*gauges.values(), preemptions)
