"""GET /api/admin/stats and /metrics over canned worker snapshots: only the gateway call is replaced
(``controlplane.runtime.gateway.call``); tenants and deployments are created through the services.

Two running workers (``tiny-llama`` with L1 + L2, ``small-llama`` with L1 only, different bytes per
block) and one that does not answer. The canned snapshots have the shape of
``CacheEngine.snapshot()`` plus the worker's ``worker`` key; ``install_gateway`` and ``setup_cluster``
are reused by the dashboard test (tests/ui/test_dashboard_tiers.py).
"""

from __future__ import annotations

import copy

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.django_db

HIST = [0] * 8


def _tier(**values) -> dict:
    row = {"hits": 0, "hit_tokens": 0, "bytes_in": 0, "bytes_out": 0, "failures": 0, "corrupt_loads": 0,
           "late_loads": 0, "fallbacks_to_recompute": 0, "promotions": 0, "demotions": 0, "load_seconds": 0.0,
           "load_latency": {"p50": None, "p99": None}, "capacity_blocks": 0, "used_blocks": 0, "evictions": 0}
    row.update(values)
    return row


def _usage(tenant: str, model: str, *, requests, query, lookup, load, effective, misses, stored=0) -> dict:
    return {"tenant": tenant, "model": model, "requests": requests, "query_tokens": query,
            "lookup_hit_tokens": lookup, "load_success_tokens": load, "effective_hit_tokens": effective,
            "stored_tokens": stored, "hit_histogram": [misses, *HIST[1:]], "saved_prefill_seconds": 0.25,
            "prefill_seconds": 1.0, "effective_hit_ratio": round(effective / query, 4)}


def _totals(usage: list[dict]) -> dict:
    keys = ("requests", "query_tokens", "lookup_hit_tokens", "load_success_tokens", "effective_hit_tokens",
            "stored_tokens", "saved_prefill_seconds", "prefill_seconds")
    totals = {k: sum(r[k] for r in usage) for k in keys}
    totals["effective_hit_ratio"] = round(totals["effective_hit_tokens"] / totals["query_tokens"], 4)
    return totals


def _snapshot(model: str, *, usage: list[dict], tiers: dict, resident: dict, bytes_per_block: int) -> dict:
    return {
        "totals": _totals(usage), "usage": usage, "tiers": tiers, "resident_blocks": resident,
        "bytes_per_block": bytes_per_block,
        "pool": {"total": tiers["l1"]["capacity_blocks"], "protected": 4, "evictable": 6,
                 "free": tiers["l1"]["capacity_blocks"] - 10, "block_size": 16},
        "load_policy": {"policy": "cost", "decisions": {"load": 5, "recompute": 3}},
        "write_policy": "write-back", "evictions": tiers["l1"]["evictions"], "duplicate_stores": 1,
        "promotions": 4, "flushed_blocks": 0, "hit_buckets": [0, 16, 64, 256, 1024, 4096, 16384],
        "worker": {"deployment": model, "revision": "r1", "cancelled": 0, "tenant_busy": 0},
    }


def canned_snapshots(ids: dict[str, str]) -> dict[str, dict]:
    """Per deployment name, what its worker's ``stats()`` answers (``ids``: slug -> tenant id)."""
    acme, beta = ids["acme"], ids["beta"]
    tiny = _snapshot(
        "tiny-llama",
        usage=[_usage(acme, "tiny-llama", requests=4, query=1000, lookup=640, load=512, effective=496, misses=1,
                      stored=300),
               _usage(beta, "tiny-llama", requests=2, query=200, lookup=32, load=16, effective=16, misses=1)],
        tiers={"l1": _tier(hits=10, hit_tokens=400, bytes_out=25_600, failures=1, fallbacks_to_recompute=2,
                           load_seconds=0.01, load_latency={"p50": 0.001, "p99": 0.004},
                           capacity_blocks=100, used_blocks=40, evictions=5),
               "l2": _tier(hits=4, hit_tokens=112, bytes_in=8192, bytes_out=7168, corrupt_loads=1, late_loads=1,
                           fallbacks_to_recompute=1, promotions=7, demotions=8, load_seconds=0.02,
                           load_latency={"p50": 0.002, "p99": 0.01}, capacity_blocks=400, used_blocks=8,
                           rejected_puts=2)},
        resident={"l1": {acme: 30, beta: 10}, "l2": {acme: 8}},
        bytes_per_block=1024,
    )
    small = _snapshot(
        "small-llama",
        usage=[_usage(acme, "small-llama", requests=1, query=300, lookup=256, load=256, effective=256, misses=0)],
        tiers={"l1": _tier(hits=2, hit_tokens=256, bytes_out=32_768, failures=2, corrupt_loads=0,
                           fallbacks_to_recompute=1, load_seconds=0.006, load_latency={"p50": 0.003, "p99": 0.003},
                           capacity_blocks=50, used_blocks=20, evictions=1)},
        resident={"l1": {acme: 5}},
        bytes_per_block=2048,
    )
    return {"tiny-llama": tiny, "small-llama": small}


def install_gateway(monkeypatch, snapshots: dict[str, dict]) -> list[str]:
    """Replace the gateway call: a deployment in ``snapshots`` answers a fresh copy of its snapshot,
    any other is unreachable. Returns the deployments asked, in order."""
    from controlplane.common.errors import Unavailable
    from controlplane.runtime import gateway

    asked: list[str] = []

    def call(spec, method, *args, **kwargs):
        assert method == "stats" and kwargs.get("create") is False
        asked.append(spec.deployment)
        if spec.deployment not in snapshots:
            raise Unavailable(f"worker {spec.deployment} did not answer stats", retry_after=5)
        return copy.deepcopy(snapshots[spec.deployment])

    monkeypatch.setattr(gateway, "call", call)
    return asked


def setup_cluster(actor, monkeypatch) -> dict[str, str]:
    """Tenants acme and beta (acme may already exist), deployments tiny-llama (may already exist),
    small-llama and down-llama (unreachable), and the canned gateway. Returns slug -> tenant id."""
    from controlplane.registry.models import ModelDeployment
    from controlplane.registry.services import model_create
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.services import tenant_create

    for slug in ("acme", "beta"):
        if not Tenant.objects.filter(slug=slug).exists():
            tenant_create(actor=actor, slug=slug, name=slug.title())
    for name, seed in (("tiny-llama", 7), ("small-llama", 8), ("down-llama", 9)):
        if not ModelDeployment.objects.filter(name=name).exists():
            model_create(actor=actor, name=name, preset="tiny", revision={"label": "r1", "seed": seed})
    ids = {slug: str(pk) for pk, slug in Tenant.objects.values_list("pk", "slug")}
    install_gateway(monkeypatch, canned_snapshots(ids))
    return ids


# ---------------------------------------------------------------------- GET /api/admin/stats
@pytest.fixture
def cluster(actor, monkeypatch):
    return setup_cluster(actor, monkeypatch)


def test_stats_sums_each_tier_over_workers(admin_client, cluster):
    response = admin_client.get("/api/admin/stats")
    assert response.status_code == 200, response.content[:300]
    stats = response.json()
    assert list(stats["tiers"]) == ["l1", "l2"]
    l1, l2 = stats["tiers"]["l1"], stats["tiers"]["l2"]
    assert (l1["hits"], l1["hit_tokens"], l1["bytes_out"], l1["bytes_in"]) == (12, 656, 58_368, 0)
    assert (l1["failures"], l1["corrupt_loads"], l1["fallbacks_to_recompute"]) == (3, 0, 3)
    assert (l1["capacity_blocks"], l1["used_blocks"], l1["evictions"]) == (150, 60, 6)
    assert l1["capacity_bytes"] == 100 * 1024 + 50 * 2048 and l1["used_bytes"] == 40 * 1024 + 20 * 2048
    assert l1["load_latency"] == {"p50": 0.003, "p99": 0.004}  # the worst worker's, per quantile
    assert l1["load_seconds"] == pytest.approx(0.016)
    # L2 only on tiny-llama: its figures as the worker gave them, bytes from its 1 KiB blocks
    assert (l2["hits"], l2["bytes_in"], l2["bytes_out"], l2["corrupt_loads"], l2["late_loads"]) == (4, 8192, 7168, 1, 1)
    assert (l2["promotions"], l2["demotions"], l2["rejected_puts"]) == (7, 8, 2) and "rejected_puts" not in l1
    assert (l2["capacity_bytes"], l2["used_bytes"]) == (400 * 1024, 8 * 1024)
    assert l2["load_latency"] == {"p50": 0.002, "p99": 0.01}


def test_stats_give_each_tenant_its_resident_bytes_per_tier_by_slug(admin_client, cluster):
    stats = admin_client.get("/api/admin/stats").json()
    tenants = {t["tenant"]: t for t in stats["tenants"]}
    assert set(tenants) == {"acme", "beta"}  # slugs, never tenant ids
    assert tenants["acme"]["resident_bytes"] == {"l1": 30 * 1024 + 5 * 2048, "l2": 8 * 1024}
    assert tenants["beta"]["resident_bytes"] == {"l1": 10 * 1024, "l2": 0}
    tiny = next(w for w in stats["workers"] if w["model"] == "tiny-llama")
    assert tiny["resident_bytes"] == {"l1": {"acme": 30 * 1024, "beta": 10 * 1024}, "l2": {"acme": 8 * 1024}}
    assert {r["tenant"] for r in tiny["usage"]} == {"acme", "beta"}
    assert tiny["tiers"]["l2"]["capacity_bytes"] == 400 * 1024


def test_stats_keep_the_token_layers_apart_with_the_effective_ratio_as_headline(admin_client, cluster):
    stats = admin_client.get("/api/admin/stats").json()
    totals = stats["totals"]
    assert (totals["query_tokens"], totals["lookup_hit_tokens"], totals["load_success_tokens"],
            totals["effective_hit_tokens"]) == (1500, 928, 784, 768)
    assert totals["effective_hit_ratio"] == round(768 / 1500, 4)
    assert totals["lookup_hit_ratio"] == round(928 / 1500, 4)
    assert totals["load_success_ratio"] == round(784 / 1500, 4)
    assert totals["requests"] == 7 and totals["saved_prefill_seconds"] == pytest.approx(0.75)
    acme = next(t for t in stats["tenants"] if t["tenant"] == "acme")
    assert (acme["query_tokens"], acme["lookup_hit_tokens"], acme["load_success_tokens"],
            acme["effective_hit_tokens"]) == (1300, 896, 768, 752)
    assert acme["effective_hit_ratio"] == round(752 / 1300, 4)
    assert acme["load_success_ratio"] == round(768 / 1300, 4)
    assert (acme["requests"], acme["hit_requests"]) == (5, 4)  # secondary: request counts


def test_an_unreachable_worker_is_listed_and_fails_nothing(admin_client, cluster):
    response = admin_client.get("/api/admin/stats")
    assert response.status_code == 200
    states = {w["model"]: w["status"] for w in response.json()["workers"]}
    assert states == {"down-llama": "unreachable", "small-llama": "ok", "tiny-llama": "ok"}


def test_stats_without_any_worker_have_empty_tiers(admin_client, monkeypatch):
    install_gateway(monkeypatch, {})
    stats = admin_client.get("/api/admin/stats").json()
    assert stats["tiers"] == {} and stats["tenants"] == []
    assert stats["totals"]["effective_hit_ratio"] == 0.0 and stats["totals"]["lookup_hit_ratio"] == 0.0


def test_stats_schema_is_in_the_openapi_document(admin_client):
    doc = admin_client.get("/api/admin/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"StatsOut", "TierStatsOut", "TenantStatsOut"} <= set(schemas)
    assert "resident_bytes" in schemas["TenantStatsOut"]["properties"]


# ---------------------------------------------------------------------- /metrics
def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def test_metrics_show_tiers_per_model_and_resident_bytes_per_tenant(admin_client, cluster):
    response = admin_client.get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    samples = _samples(text)
    assert _value(samples, "strata_tier_hits_total", tier="l1", model="tiny-llama", replica="0") == 10
    assert _value(samples, "strata_tier_hits_total", tier="l1", model="small-llama", replica="0") == 2
    assert _value(samples, "strata_tier_hits_total", tier="l2", model="tiny-llama", replica="0") == 4
    no_l2 = frozenset({"tier": "l2", "model": "small-llama", "replica": "0"}.items())
    assert ("strata_tier_hits_total", no_l2) not in samples
    assert _value(samples, "strata_tier_bytes_total", tier="l2", model="tiny-llama",
                  replica="0", direction="in") == 8192
    assert _value(samples, "strata_tier_bytes_total", tier="l2", model="tiny-llama",
                  replica="0", direction="out") == 7168
    assert _value(samples, "strata_tier_failures_total", tier="l1", model="small-llama", replica="0") == 2
    assert _value(samples, "strata_tier_corrupt_loads_total", tier="l2", model="tiny-llama", replica="0") == 1
    assert _value(samples, "strata_tier_fallbacks_total", tier="l1", model="tiny-llama", replica="0") == 2
    assert _value(samples, "strata_tier_promotions_total", tier="l2", model="tiny-llama", replica="0") == 7
    assert _value(samples, "strata_tier_demotions_total", tier="l2", model="tiny-llama", replica="0") == 8
    assert _value(samples, "strata_tier_capacity_blocks", tier="l2", model="tiny-llama", replica="0") == 400
    assert _value(samples, "strata_tier_used_blocks", tier="l1", model="small-llama", replica="0") == 20
    assert _value(samples, "strata_tier_load_latency_seconds", tier="l2", model="tiny-llama",
                  replica="0", quantile="0.5") == 0.002
    assert _value(samples, "strata_tier_load_latency_seconds", tier="l2", model="tiny-llama",
                  replica="0", quantile="0.99") == 0.01
    assert _value(samples, "strata_resident_bytes", tenant="acme", model="tiny-llama",
                  replica="0", tier="l1") == 30 * 1024
    assert _value(samples, "strata_resident_bytes", tenant="acme", model="small-llama",
                  replica="0", tier="l1") == 5 * 2048
    assert _value(samples, "strata_resident_bytes", tenant="beta", model="tiny-llama",
                  replica="0", tier="l1") == 10 * 1024
    assert _value(samples, "strata_resident_bytes", tenant="acme", model="tiny-llama",
                  replica="0", tier="l2") == 8 * 1024
    # the token layers, per tenant (slug) and model
    assert _value(samples, "strata_load_success_tokens_total", tenant="acme", model="tiny-llama", replica="0") == 512
    assert _value(samples, "strata_lookup_hit_tokens_total", tenant="acme", model="tiny-llama", replica="0") == 640
    assert _value(samples, "strata_effective_hit_tokens_total", tenant="acme", model="tiny-llama", replica="0") == 496
    assert _value(samples, "strata_worker_up", model="down-llama", replica="0") == 0
    ids = set(cluster.values())
    assert not any(label in ids for (_, labels) in samples for _, label in labels)  # slugs only


def test_metrics_leave_out_latency_quantiles_no_load_has_timed(admin_client, actor, monkeypatch):
    ids = setup_cluster(actor, monkeypatch)
    snapshots = canned_snapshots(ids)
    snapshots["small-llama"]["tiers"]["l1"]["load_latency"] = {"p50": None, "p99": None}
    install_gateway(monkeypatch, snapshots)
    samples = _samples(admin_client.get("/metrics").content.decode())
    assert not any(name == "strata_tier_load_latency_seconds" and ("model", "small-llama") in labels
                   for name, labels in samples)
    assert _value(samples, "strata_tier_load_latency_seconds", tier="l1", model="tiny-llama",
                  replica="0", quantile="0.99") == 0.004


def test_resident_bytes_labels_stay_bounded(monkeypatch):
    from controlplane.runtime import stats

    monkeypatch.setattr(stats, "MAX_TENANT_LABELS", 2)
    snap = {"bytes_per_block": 10, "resident_blocks": {"l1": {"a": 5, "b": 1, "c": 3, "d": 2}}}
    assert stats.worker_resident_bytes(snap, {"a": "alpha"}) == {"l1": {"alpha": 50, "c": 30, "other": 30}}
