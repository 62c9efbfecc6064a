"""Serving health for ``/metrics``: what the serving API answered, how fast, to whom. Measured at the
ASGI edge (``ServingMetrics``, outermost for ``/v1/``), so refusals the gate or the body limit answer
before any view are counted too.

- ``strata_http_requests_total{route, status, code}``: every ``/v1/`` response by route (a fixed set),
  HTTP status and error code (``code`` of the JSON error body; empty for a success). 429s by quota
  read ``rate_limit_requests``, ``rate_limit_tokens``, ...; the 413s ``request_too_large`` etc.
- ``strata_tenant_requests_total{tenant, model, outcome}``: per tenant (slug) and model, ``ok`` or the
  error code: only for requests whose tenant was authenticated (tenants and models are the operator's
  bounded sets).
- ``strata_request_seconds{route, model}``: end to end, from the request's arrival to its last byte.
- ``strata_ttft_seconds{route, model}``: streamed requests, arrival to the first body chunk (the first
  token's event: the response starts when the prompt is computed).
- ``strata_tenant_ttft_seconds{tenant, model}``: the same TTFT per tenant.
- ``strata_tenant_queue_seconds{tenant, model}``: completions and chats per tenant, arrival until the
  request is handed to a replica (the gate, the render threads' queue, parsing and templating); the
  replica's own queue shows in its TTFT and, on vLLM, in ``strata_vllm_requests_waiting``.
- Tokens in and out per tenant and model are the ledger's ``strata_ledger_tokens_total``.

``model`` and ``tenant`` come from the view and the gate through a holder in the ASGI scope's state
(``NOTE``): empty when the request never got that far; they are also handed to the access log's
``common.access_log.AccessNote``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from controlplane.common.access_log import access_note_of

NOTE = "strata.metrics"  # the scope-state key of a request's ``Note``
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/kv/layout", "/v1/kv/lookup",
          "/v1/kv/store", "/v1/kv/retrieve", "/v1/caches")
ROUTES = (*ROUTES, "/v1/messages")  # Anthropic's Messages API
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
MAX_CODE = 48

REGISTRY = CollectorRegistry(auto_describe=True)
REQUESTS = Counter("strata_http_requests", "Serving API responses by route, HTTP status and error code",
                   ["route", "status", "code"], registry=REGISTRY)
TENANT_REQUESTS = Counter("strata_tenant_requests", "Serving API responses per tenant and model: ok or the "
                          "error code", ["tenant", "model", "outcome"], registry=REGISTRY)
LATENCY = Histogram("strata_request_seconds", "Serving API requests, arrival to last byte", ["route", "model"],
                    buckets=LATENCY_BUCKETS, registry=REGISTRY)
TTFT = Histogram("strata_ttft_seconds", "Streamed serving requests, arrival to the first token's chunk",
                 ["route", "model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
# tenants are authenticated rows and models their granted deployments: bounded label sets
TENANT_TTFT = Histogram("strata_tenant_ttft_seconds", "Streamed serving requests per tenant, arrival to the "
                        "first token's chunk", ["tenant", "model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
TENANT_QUEUE = Histogram("strata_tenant_queue_seconds", "Completions per tenant, arrival until handed to a "
                         "replica", ["tenant", "model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)


@dataclass
class Note:
    """What the inner layers learn about a request (the gate: tenant; the view: model, stream)."""

    tenant: str = ""
    model: str = ""
    stream: bool = False
    dispatched: float | None = None  # perf_counter when the view handed the request to a replica


def note_of(scope: dict) -> Note | None:
    found = (scope.get("state") or {}).get(NOTE)
    return found if isinstance(found, Note) else None


def route_of(path: str) -> str:
    path = path.rstrip("/") or "/"
    if path.startswith("/v1/caches"):
        return "/v1/caches"
    if path.startswith("/v1/responses"):  # a response's id never becomes a label
        return "/v1/responses"
    return path if path in ROUTES else "other"


def _code(status: int, body: bytes) -> str:
    if status < 400:
        return ""
    try:
        code = json.loads(body.decode("utf-8"))["error"]["code"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "unknown"
    return str(code)[:MAX_CODE] if isinstance(code, str) and code.isascii() else "unknown"


class ServingMetrics:
    """ASGI middleware: counts and times every ``/v1/`` response (see the module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        note = Note()
        scope = {**scope, "state": {**(scope.get("state") or {}), NOTE: note}}
        start = time.perf_counter()
        seen = {"status": 0, "first": None, "body": b""}

        async def observed(message):
            if message["type"] == "http.response.start":
                seen["status"] = int(message.get("status", 0))
            elif message["type"] == "http.response.body":
                if seen["first"] is None and message.get("body"):
                    seen["first"] = time.perf_counter()
                if seen["status"] >= 400 and len(seen["body"]) < 4096:
                    seen["body"] += message.get("body", b"")[:4096]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            self._record(scope, note, seen, start)

    @staticmethod
    def _record(scope, note: Note, seen: dict, start: float) -> None:
        route, status = route_of(scope.get("path", "")), seen["status"]
        code = _code(status, seen["body"]) if status else "disconnected"
        REQUESTS.labels(route, str(status), code).inc()
        LATENCY.labels(route, note.model).observe(time.perf_counter() - start)
        if note.stream and seen["first"] is not None and status < 400:
            TTFT.labels(route, note.model).observe(seen["first"] - start)
        if note.tenant:
            TENANT_REQUESTS.labels(note.tenant, note.model, code or "ok").inc()
        if note.tenant and note.model:
            if note.stream and seen["first"] is not None and status < 400:
                TENANT_TTFT.labels(note.tenant, note.model).observe(seen["first"] - start)
            if note.dispatched is not None:
                TENANT_QUEUE.labels(note.tenant, note.model).observe(max(0.0, note.dispatched - start))
        access = access_note_of(scope)
        if access is not None:
            access.tenant, access.model = note.tenant, note.model


# ---------------------------------------------------------------------- reads (the console's)
def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """``q`` of a cumulative histogram ``[(upper bound, count)]`` (linear within a bucket, as
    Prometheus's ``histogram_quantile``); None without observations."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * ((rank - below) / max(count - below, 1e-12))
        lower, below = upper, count
    return lower


def _histograms(metric) -> dict[tuple, list[tuple[float, float]]]:
    out: dict[tuple, list[tuple[float, float]]] = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                key = (s.labels["route"], s.labels["model"])
                out.setdefault(key, []).append((float(s.labels["le"]), s.value))
    return {k: sorted(v) for k, v in out.items()}


def serving_summary(tenant: str | None = None) -> dict:
    """What this web process answered since it started, for the console: ``responses`` by route,
    status and code (most first), ``latency`` per route and model (count, p50/p99 end to end and
    TTFT), and, with ``tenant``, that tenant's outcomes per model."""
    responses = [{"route": s.labels["route"], "status": s.labels["status"], "code": s.labels["code"] or "—",
                  "count": int(s.value)}
                 for f in REQUESTS.collect() for s in f.samples if s.name.endswith("_total") and s.value]
    responses.sort(key=lambda r: (-r["count"], r["route"], r["status"]))
    e2e, ttft = _histograms(LATENCY), _histograms(TTFT)
    latency = []
    for (route, model), buckets in sorted(e2e.items()):
        if not buckets[-1][1]:
            continue
        t = ttft.get((route, model))
        latency.append({"route": route, "model": model or "—", "count": int(buckets[-1][1]),
                        "p50": _quantile(0.5, buckets), "p99": _quantile(0.99, buckets),
                        "ttft_p50": _quantile(0.5, t) if t else None, "ttft_p99": _quantile(0.99, t) if t else None})
    out = {"responses": responses, "latency": latency, "refusals": sum(r["count"] for r in responses
                                                                       if r["status"].startswith(("4", "5")))}
    if tenant is not None:
        out["tenant"] = sorted(({"model": s.labels["model"] or "—", "outcome": s.labels["outcome"],
                                 "count": int(s.value)}
                                for f in TENANT_REQUESTS.collect() for s in f.samples
                                if s.name.endswith("_total") and s.labels["tenant"] == tenant and s.value),
                               key=lambda r: (-r["count"], r["outcome"]))
    return out
