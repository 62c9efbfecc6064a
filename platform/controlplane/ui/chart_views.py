"""The console's chart sets: :func:`chartset` (what ``ui/_charts.html`` renders: the charts, their
JSON for charts.js, the range choices) and the JSON endpoints charts.js reads to switch the range in
place and to refresh a trend set every sample interval (``?range=1h|6h|24h``; anything else is the
default range, never an error)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import reverse
from django.views.decorators.http import require_GET

from controlplane.tenants.selectors import tenant_get
from controlplane.timeseries.config import sampler_config
from controlplane.ui import trend_charts
from controlplane.ui.access import operator_view
from controlplane.ui.chart_spec import Chart, charts_json


def _step_text(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _trend_meta(range_name: str) -> dict[str, Any]:
    step = trend_charts.window_step(range_name)
    return {"range": range_name, "ranges": list(trend_charts.RANGES), "step": step,
            "step_text": _step_text(step)}


def chartset(set_id: str, charts: Sequence[Chart], *, src: str | None = None,
             range_name: str | None = None) -> dict[str, Any]:
    """The context of one ``ui/_charts.html``: a trend set (``src`` and ``range_name``: range links,
    refreshed every sample interval) or a fixed one (no range, no refresh)."""
    meta = _trend_meta(range_name) if range_name else {}
    return {"id": set_id, "json_id": f"{set_id}-data", "charts": list(charts), "src": src,
            "refresh_ms": 1000 * sampler_config().interval_seconds,
            "json": charts_json(charts, **meta), **meta}


def dashboard_chartset(range_name: str | None) -> dict[str, Any]:
    range_name = trend_charts.range_choice(range_name)
    return chartset("trends", trend_charts.dashboard_charts(range_name), src=reverse("ui:charts-cluster"),
                    range_name=range_name)


def tenant_chartset(slug: str, range_name: str | None) -> dict[str, Any]:
    range_name = trend_charts.range_choice(range_name)
    return chartset("trends", trend_charts.tenant_charts(slug, range_name),
                    src=reverse("ui:charts-tenant", kwargs={"slug": slug}), range_name=range_name)


def _json(set_: dict[str, Any]) -> JsonResponse:
    response = JsonResponse(set_["json"])
    response["Cache-Control"] = "no-store"
    return response


@operator_view
@require_GET
def cluster_charts(request: HttpRequest) -> JsonResponse:
    return _json(dashboard_chartset(request.GET.get("range")))


@operator_view
@require_GET
def tenant_charts(request: HttpRequest, slug: str) -> JsonResponse:
    tenant = tenant_get(slug=slug)  # 404 (ApplicationError) for an unknown tenant
    return _json(tenant_chartset(tenant.slug, request.GET.get("range")))
