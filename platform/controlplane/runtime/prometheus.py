"""/metrics: Prometheus text exposition of the cache figures (token-weighted, per tenant and model).

Gathered on each scrape from the last sample of each worker (``stats.cluster_stats``: no call to a
worker on the scrape, ``strata_worker_sample_age_seconds`` says how old), the jobs table and the audit
chain's two heads (``strata_audit_head_seq``: the database's head row and the external head log),
so the scraping Prometheus keeps a history of the head that nobody with database access can rewind
(alert when it decreases). Tenant labels are slugs, bounded by the engine's label cap (resident bytes
by the same cap in ``stats.worker_resident_bytes``). Operator credentials are required (a viewer
token is enough): tenant names and traffic volumes are not public.

Per tier (``tier`` = l1, l2, l3) and model: ``strata_tier_*_total`` counters (hits, hit tokens,
bytes in/out by ``direction``, failures, corrupt and late loads, fallbacks to recompute, promotions,
demotions, evictions), ``strata_tier_capacity_blocks`` / ``strata_tier_used_blocks`` (and bytes)
gauges, ``strata_tier_load_latency_seconds{quantile="0.5"|"0.99"}`` (the worker's own estimate,
absent until a load was timed); per tenant, model and tier ``strata_resident_bytes``.

From the tenant cache ledger (its all-time sums, so counters survive worker restarts; tenants x
models x fixed kinds): ``strata_ledger_tokens_total{tenant,model,kind}`` (kind = prompt, cached_l1,
cached_l2, cached_l3, write, completion) and ``strata_ledger_miss_tokens_total{tenant,model,reason}``
(the fixed miss reasons; ``other`` only once counted). A request on a LoRA adapter is its own line:
its ``model`` label is the adapter's name (as in the ledger and the serving series of
``serving.health``), and ``strata_adapter_info{adapter,model,tenant}`` (1 per adapter that is not
deleted; ``tenant`` empty for a public one) maps it to its base model. Adapters are registered rows,
so the label set stays bounded.

The alert rules (``deploy/prometheus/alerts.yml``) read these too, and a few series exist for them:
``strata_tier_breaker_open{tier,model,replica}`` (1 while the replica's L3 backend failed and has not
answered since: its circuit breaker is open or half-open) and ``strata_tier_breaker_opens_total``;
``strata_jobs_finished_total{kind,status}`` (jobs that reached ``succeeded``, ``partial`` or
``failed``, counted from the jobs table: rows are never deleted and a final status never changes, so
it only grows, and every web process reports the same figure; every kind and final status is listed
from 0 so that the first failure is an increase); ``strata_audit_verify_ok``,
``strata_audit_verify_timestamp_seconds`` and ``strata_audit_verify_failures_total`` (the chain's
last scheduled verification, ``audit.checks``; absent until one has finished).

vLLM's engine figures per replica (KV cache usage, waiting and running requests, preemptions):
``runtime.engine_metrics``.

Every per-worker series carries a ``replica`` label (the replica index, at most the admin API's bound
of 16 per model), so a restarted replica resets only its own counters; sum over ``replica`` for the
model's figure.
"""

from __future__ import annotations

from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controlplane.adminapi.auth import OperatorAuth
from controlplane.audit.checks import CheckStatus, audit_check_status
from controlplane.audit.selectors import audit_head_status
from controlplane.common.errors import ApplicationError, error_response
from controlplane.jobs.models import FlushJob
from controlplane.runtime import stats
from controlplane.runtime.engine_metrics import EngineCollector

USAGE_COUNTERS = {
    "query_tokens": "Prompt tokens presented to the cache",
    "lookup_hit_tokens": "Prompt tokens the index held",
    "load_success_tokens": "Prompt tokens whose KV bytes arrived",
    "effective_hit_tokens": "Prompt tokens whose prefill was skipped",
    "stored_tokens": "Tokens newly stored in the cache",
    "requests": "Requests served",
}

TIER_COUNTERS = {  # snapshot field -> (metric name, help); names get ``_total`` on exposition
    "hits": ("strata_tier_hits", "Loads served from the tier"),
    "hit_tokens": ("strata_tier_hit_tokens", "Tokens whose KV was loaded from the tier"),
    "failures": ("strata_tier_failures", "Loads from the tier that failed"),
    "corrupt_loads": ("strata_tier_corrupt_loads", "Loads from the tier whose bytes failed their check"),
    "late_loads": ("strata_tier_late_loads", "Loads from the tier that missed their deadline"),
    "fallbacks_to_recompute": ("strata_tier_fallbacks", "Prefixes the tier held but that were recomputed"),
    "promotions": ("strata_tier_promotions", "Blocks copied up from the tier into L1"),
    "demotions": ("strata_tier_demotions", "Blocks written down into the tier"),
    "evictions": ("strata_tier_evictions", "Blocks evicted from the tier"),
}
TIER_GAUGES = {
    "capacity_blocks": ("strata_tier_capacity_blocks", "Blocks the tier can hold"),
    "used_blocks": ("strata_tier_used_blocks", "Blocks the tier holds"),
    "capacity_bytes": ("strata_tier_capacity_bytes", "Bytes of KV the tier can hold"),
    "used_bytes": ("strata_tier_used_bytes", "Bytes of KV the tier holds"),
}
QUANTILES = {"p50": "0.5", "p99": "0.99"}
# a worker row's ``status`` (``runtime.samples``) -> its ``strata_worker_state``; anything else is down
WORKER_STATES = {"ok": "up", "not started": "not_started", "starting": "starting", "pending": "unknown"}
LEDGER_KINDS = {"prompt": "prompt_tokens", "cached_l1": "cached_l1", "cached_l2": "cached_l2",
                "cached_l3": "cached_l3", "write": "write_tokens", "completion": "completion_tokens"}


class _Collector:
    def __init__(self, snapshot: dict, jobs: dict[str, int], audit_heads: dict[str, int | None],
                 finished: dict[tuple[str, str], int] | None = None, audit_check: CheckStatus | None = None) -> None:
        self.snapshot, self.jobs, self.audit_heads = snapshot, jobs, audit_heads
        self.finished, self.audit_check = finished or {}, audit_check

    def collect(self):
        worker = ["model", "replica"]
        up = GaugeMetricFamily("strata_worker_up", "1 if the started replica answered, 0 if it is down (a replica "
                               "never started is not listed: see strata_worker_state)", labels=worker)
        worker_states = GaugeMetricFamily("strata_worker_state", "1 for the replica's state: up, down (started, not "
                                  "answering), not_started, starting (its constructor runs: not asked) or "
                                  "unknown (not polled yet)", labels=["model", "replica", "state"])
        age = GaugeMetricFamily("strata_worker_sample_age_seconds", "Age of the replica's last stats sample "
                                "(what every figure here comes from)", labels=worker)
        pages = GaugeMetricFamily("strata_pages", "L1 pages by state", labels=["model", "replica", "state"])
        evictions = CounterMetricFamily("strata_evictions", "Cached blocks evicted", labels=worker)
        dupes = CounterMetricFamily("strata_duplicate_stores", "Stores of blocks already cached", labels=worker)
        saved = CounterMetricFamily("strata_saved_prefill_seconds", "Estimated prefill seconds saved",
                                    labels=["tenant", "model", "replica"])
        usage = {k: CounterMetricFamily(f"strata_{k}", help_, labels=["tenant", "model", "replica"])
                 for k, help_ in USAGE_COUNTERS.items()}
        tier_counters = {k: CounterMetricFamily(name, help_, labels=["tier", "model", "replica"])
                         for k, (name, help_) in TIER_COUNTERS.items()}
        tier_gauges = {k: GaugeMetricFamily(name, help_, labels=["tier", "model", "replica"])
                       for k, (name, help_) in TIER_GAUGES.items()}
        tier_bytes = CounterMetricFamily("strata_tier_bytes", "Bytes moved into (in) and out of (out) the tier",
                                         labels=["tier", "model", "replica", "direction"])
        latency = GaugeMetricFamily("strata_tier_load_latency_seconds", "Load latency of the tier",
                                    labels=["tier", "model", "replica", "quantile"])
        resident = GaugeMetricFamily("strata_resident_bytes", "Bytes of KV a tenant holds in a tier",
                                     labels=["tenant", "model", "replica", "tier"])
        breaker = GaugeMetricFamily("strata_tier_breaker_open", "1 while the tier's backend failed and has not "
                                    "answered since (its circuit breaker is open or half-open)",
                                    labels=["tier", "model", "replica"])
        breaker_opens = CounterMetricFamily("strata_tier_breaker_opens", "Times the tier's circuit breaker opened",
                                            labels=["tier", "model", "replica"])
        for w in self.snapshot["workers"]:
            model, replica = w["model"], str(w.get("replica", 0))
            now = WORKER_STATES.get(w["status"], "down")
            for name in (*dict.fromkeys(WORKER_STATES.values()), "down"):
                worker_states.add_metric([model, replica, name], 1.0 if name == now else 0.0)
            if now in ("up", "down"):  # an alert on up == 0 fires for a replica that is down, never for one not
                up.add_metric([model, replica], 1.0 if now == "up" else 0.0)  # used yet or still starting
            if w.get("age_s") is not None:
                age.add_metric([model, replica], w["age_s"])
            if w["status"] != "ok":
                continue
            for state in ("protected", "evictable", "free"):
                pages.add_metric([model, replica, state], w["pool"].get(state, 0))
            evictions.add_metric([model, replica], w.get("evictions", 0))
            dupes.add_metric([model, replica], w.get("duplicate_stores", 0))
            for row in w["usage"]:
                for key, fam in usage.items():
                    fam.add_metric([row["tenant"], model, replica], row.get(key, 0))
                saved.add_metric([row["tenant"], model, replica], row.get("saved_prefill_seconds", 0.0))
            for tier, row in w.get("tiers", {}).items():
                for key, fam in (*tier_counters.items(), *tier_gauges.items()):
                    fam.add_metric([tier, model, replica], row.get(key, 0))
                tier_bytes.add_metric([tier, model, replica, "in"], row.get("bytes_in", 0))
                tier_bytes.add_metric([tier, model, replica, "out"], row.get("bytes_out", 0))
                if "breaker_open" in row:  # tiers with a remote backend (L3) only
                    breaker.add_metric([tier, model, replica], row["breaker_open"])
                    breaker_opens.add_metric([tier, model, replica], row.get("breaker_opens", 0))
                for q, label in QUANTILES.items():
                    value = (row.get("load_latency") or {}).get(q)
                    if value is not None:
                        latency.add_metric([tier, model, replica, label], value)
            for tier, owners in w.get("resident_bytes", {}).items():
                for tenant, nbytes in owners.items():
                    resident.add_metric([tenant, model, replica, tier], nbytes)
        jobs = GaugeMetricFamily("strata_jobs", "Flush and rollout jobs by status", labels=["status"])
        for status, n in self.jobs.items():
            jobs.add_metric([status], n)
        heads = GaugeMetricFamily("strata_audit_head_seq", "Seq of the audit chain head, as recorded in the "
                                  "database head row and in the external head log", labels=["store"])
        for store, seq in self.audit_heads.items():
            if seq is not None:
                heads.add_metric([store], seq)
        finished = CounterMetricFamily("strata_jobs_finished", "Jobs that reached a final status, by kind and "
                                       "status (from the jobs table)", labels=["kind", "status"])
        for kind in FlushJob.Kind.values:
            for status in FlushJob.FINAL:
                finished.add_metric([kind, str(status)], self.finished.get((kind, str(status)), 0))
        yield from (up, worker_states, age, pages, evictions, dupes, saved, jobs, finished, heads, *self._audit_check(),
                    *usage.values(), *tier_counters.values(), tier_bytes, *tier_gauges.values(), latency, resident,
                    breaker, breaker_opens)

    def _audit_check(self):
        check = self.audit_check
        if check is None:  # never verified yet: absent, which the staleness alert reads as "not verifying"
            return ()
        ok = GaugeMetricFamily("strata_audit_verify_ok", "1 if the audit chain's last scheduled verification "
                               "passed, 0 if it found the chain broken")
        ok.add_metric([], 1.0 if check["ok"] else 0.0)
        at = GaugeMetricFamily("strata_audit_verify_timestamp_seconds", "Unix time the last verification of the "
                               "audit chain finished")
        at.add_metric([], check["checked_at"].timestamp())
        failures = CounterMetricFamily("strata_audit_verify_failures", "Verifications that found the audit chain "
                                       "broken")
        failures.add_metric([], check["failures"])
        return ok, at, failures


class _LedgerCollector:
    """The ledger's counters: ``rows`` from ``ledger.selectors.ledger_counters()``."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def collect(self):
        from controlplane.ledger.models import MISS_REASONS, OTHER_REASON, miss_field

        tokens = CounterMetricFamily("strata_ledger_tokens", "Tokens billed in the tenant cache ledger, by kind",
                                     labels=["tenant", "model", "kind"])
        misses = CounterMetricFamily("strata_ledger_miss_tokens", "Prompt tokens not reused, by miss reason",
                                     labels=["tenant", "model", "reason"])
        for row in self.rows:
            for kind, column in LEDGER_KINDS.items():
                tokens.add_metric([row.tenant, row.model, kind], row.counts[column])
            for reason in (*MISS_REASONS, OTHER_REASON):
                value = row.counts[miss_field(reason)]
                if reason != OTHER_REASON or value:
                    misses.add_metric([row.tenant, row.model, reason], value)
        yield from (tokens, misses)


class _AdapterCollector:
    """``strata_adapter_info``: ``rows`` are (adapter, base model, tenant slug or "") of the adapters."""

    def __init__(self, rows: list[tuple[str, str, str]]) -> None:
        self.rows = rows

    def collect(self):
        info = GaugeMetricFamily("strata_adapter_info", "1 per LoRA adapter: its base model and its tenant (empty "
                                 "for a public one); the adapter's name is the model label of its figures",
                                 labels=["adapter", "model", "tenant"])
        for row in self.rows:
            info.add_metric(list(row), 1.0)
        yield info


def metrics(request: HttpRequest) -> HttpResponse:
    try:
        if OperatorAuth()(request) is None:
            return error_response(401, "operator credentials required", headers={"WWW-Authenticate": "Bearer"})
    except ApplicationError as exc:
        return exc.response()
    jobs = {s: FlushJob.objects.filter(status=s).count() for s in FlushJob.Status.values}
    finished = {(row["kind"], row["status"]): row["n"] for row in FlushJob.objects.filter(
        status__in=FlushJob.FINAL).values("kind", "status").annotate(n=Count("id")).order_by()}
    registry = CollectorRegistry()
    snapshot = stats.cluster_stats()
    registry.register(_Collector(snapshot, jobs, dict(audit_head_status()), finished, audit_check_status()))
    registry.register(EngineCollector(snapshot["workers"]))  # vLLM's own figures per replica
    from controlplane.ledger.selectors import ledger_counters

    registry.register(_LedgerCollector(ledger_counters()))
    from controlplane.adapters.models import Adapter

    registry.register(_AdapterCollector([
        (name, model, tenant or "") for name, model, tenant in Adapter.objects.exclude(
            state=Adapter.State.DELETED).order_by("name").values_list("name", "deployment__name", "tenant__slug")]))
    from controlplane.serving.health import REGISTRY as SERVING  # this web process's serving counters

    body = generate_latest(registry) + generate_latest(SERVING)
    return HttpResponse(body, content_type="text/plain; version=0.0.4; charset=utf-8")
